//! The `seckill` binary: everything lives in the library; this only hands over.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    seckill::cli::main().await
}
