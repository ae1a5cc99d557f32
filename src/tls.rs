//! TLS shared by the Postgres and Redis clients (rustls with ring).

/// redis-rs builds its TLS configuration from the process's default crypto provider:
/// ring, the one sqlx uses too (no aws-lc-rs and its C toolchain).
pub(crate) fn install_crypto() {
    // Err means one is installed already (an earlier call, or the embedding program).
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The TLS failure (handshake, certificate check) somewhere in `e`'s causes, if any.
/// rustls's error travels inside an `io::Error` (whose `source()` skips it), which
/// redis-rs keeps in an `Arc`: look inside both.
pub(crate) fn failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        return Some(tls.to_string());
    }
    if let Some(inner) = e
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
    {
        if let Some(found) = failure(inner) {
            return Some(found);
        }
    }
    if let Some(shared) = e.downcast_ref::<Shared>() {
        if let Some(found) = failure(&**shared) {
            return Some(found);
        }
    }
    e.source().and_then(failure)
}
