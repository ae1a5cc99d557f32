//! Logging: `RUST_LOG` filters (default `info`), `LOG_FORMAT=json` for machines.

use tracing_subscriber::{fmt, EnvFilter};

use crate::config::LogFormat;

pub(crate) fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
