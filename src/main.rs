//! The `seckill` binary: everything lives in the library; this only hands over.

// mimalloc: the hot path allocates small, short-lived buffers per request, which glibc's
// allocator serves markedly slower under two busy threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    seckill::cli::main().await
}
