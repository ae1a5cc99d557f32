//! Where Redis is: the deployment the settings name (one node, a cluster, or Sentinel's
//! master), validated before any connection, and the TLS roots to check it with.

use crate::secret::ServerUrl;

/// Where Redis is: `REDIS_URL`, or `REDIS_CLUSTER_URLS` or `REDIS_SENTINEL_URLS` when
/// set; `rediss://` URLs speak TLS, verified against `REDIS_TLS_CA_FILE` or else the
/// system's roots (with Sentinel, to the sentinels and to the master alike).
#[derive(Debug, Clone)]
pub(crate) struct RedisTarget {
    pub nodes: RedisNodes,
    /// The CA bundle (PEM) and the setting it came from, for `rediss://`.
    tls_ca: Option<(std::path::PathBuf, Vec<u8>)>,
}

#[derive(Clone)]
pub(crate) enum RedisNodes {
    Single(String),
    Cluster(Vec<String>),
    /// The sentinels' URLs and the name of the master they monitor.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

/// The Sentinel settings: `REDIS_SENTINEL_URLS` and `REDIS_SENTINEL_MASTER`.
pub(crate) struct SentinelArgs<'a> {
    pub urls: &'a [String],
    pub master: Option<&'a str>,
}

/// The non-empty, trimmed entries of a comma-separated list setting.
fn listed(urls: &[String]) -> Vec<String> {
    urls.iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

impl RedisTarget {
    /// Validates the URLs and reads the CA file; every mistake names its setting.
    pub(crate) fn new(
        url: &str,
        cluster_urls: &[String],
        sentinel: SentinelArgs<'_>,
        tls_ca_file: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        let nodes = Self::nodes(url, listed(cluster_urls), sentinel)?;
        let setting = nodes.setting();
        let urls = nodes.urls();
        if let RedisNodes::Sentinel { sentinels, .. } = &nodes {
            for u in sentinels {
                anyhow::ensure!(
                    u.starts_with("redis://") || u.starts_with("rediss://"),
                    "{setting}: {} is not a redis:// or rediss:// URL",
                    redacted(u)
                );
            }
        }
        let tls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
        anyhow::ensure!(
            tls == 0 || tls == urls.len(),
            "{setting}: either every URL is rediss:// (TLS) or none is"
        );
        let tls_ca = match tls_ca_file {
            None => None,
            Some(_) if tls == 0 => anyhow::bail!(
                "REDIS_TLS_CA_FILE is set but {setting} is not a rediss:// URL (TLS is off)"
            ),
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|e| anyhow::anyhow!("REDIS_TLS_CA_FILE {}: {e}", path.display()))?;
                let certs = {
                    use rustls::pki_types::pem::PemObject as _;
                    rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
                }
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("REDIS_TLS_CA_FILE {}: {e}", path.display()))?;
                anyhow::ensure!(
                    !certs.is_empty(),
                    "REDIS_TLS_CA_FILE {}: no PEM certificate in it",
                    path.display()
                );
                Some((path.to_path_buf(), pem))
            }
        };
        Ok(Self { nodes, tls_ca })
    }

    /// Which deployment the settings name; Sentinel's settings come as a pair, and
    /// exclude a cluster.
    fn nodes(
        url: &str,
        seeds: Vec<String>,
        sentinel: SentinelArgs<'_>,
    ) -> anyhow::Result<RedisNodes> {
        let sentinels = listed(sentinel.urls);
        let master = sentinel.master.map(str::trim).filter(|m| !m.is_empty());
        let ignored = |by: &str| {
            if url != crate::config::DEFAULT_REDIS_URL {
                tracing::warn!("REDIS_URL is ignored: {by} is set");
            }
        };
        match (sentinels.is_empty(), master) {
            (true, None) if seeds.is_empty() => Ok(RedisNodes::Single(url.to_string())),
            (true, None) => {
                ignored("REDIS_CLUSTER_URLS");
                Ok(RedisNodes::Cluster(seeds))
            }
            (true, Some(_)) => anyhow::bail!(
                "REDIS_SENTINEL_MASTER is set but REDIS_SENTINEL_URLS is not: name the \
                 sentinels to ask for the master (or unset REDIS_SENTINEL_MASTER)"
            ),
            (false, None) => anyhow::bail!(
                "REDIS_SENTINEL_URLS is set but REDIS_SENTINEL_MASTER is not: name the \
                 master the sentinels monitor (its name in `sentinel monitor NAME ...`)"
            ),
            (false, Some(_)) if !seeds.is_empty() => anyhow::bail!(
                "REDIS_SENTINEL_URLS and REDIS_CLUSTER_URLS are both set: Sentinel and \
                 Redis Cluster are different deployments, set only one"
            ),
            (false, Some(master)) => {
                ignored("REDIS_SENTINEL_URLS");
                Ok(RedisNodes::Sentinel {
                    sentinels,
                    master: master.to_string(),
                })
            }
        }
    }

    /// A target as the tests and tools name one: a single node, system roots.
    pub(crate) fn single(url: &str) -> Self {
        Self {
            nodes: RedisNodes::Single(url.to_string()),
            tls_ca: None,
        }
    }

    pub(super) fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.tls_ca.as_ref().map(|(_, pem)| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        })
    }

    /// The setting the nodes came from.
    pub(super) fn setting(&self) -> &'static str {
        self.nodes.setting()
    }

    /// What to check when TLS fails, naming the settings.
    pub(super) fn tls_hint(&self) -> String {
        let setting = self.setting();
        match &self.tls_ca {
            Some((path, _)) => format!(
                "check {setting} (rediss://, a host name the certificate names) and that \
                 REDIS_TLS_CA_FILE ({}) holds the CA that signed the server's certificate",
                path.display()
            ),
            None => format!(
                "check {setting} (rediss://, a host name the certificate names); the \
                 certificate is checked against the system's roots: set REDIS_TLS_CA_FILE \
                 for a private CA"
            ),
        }
    }
}

/// Without the URLs' passwords.
impl std::fmt::Debug for RedisNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<_> = self.urls().iter().map(|u| redacted(u)).collect();
        match self {
            RedisNodes::Single(_) => f.debug_tuple("Single").field(&urls[0]).finish(),
            RedisNodes::Cluster(_) => f.debug_tuple("Cluster").field(&urls).finish(),
            RedisNodes::Sentinel { master, .. } => f
                .debug_struct("Sentinel")
                .field("sentinels", &urls)
                .field("master", master)
                .finish(),
        }
    }
}

/// `url` without its password, for logs.
pub(super) fn redacted(url: &str) -> ServerUrl {
    ServerUrl::from(url)
}

impl RedisNodes {
    fn setting(&self) -> &'static str {
        match self {
            RedisNodes::Single(_) => "REDIS_URL",
            RedisNodes::Cluster(_) => "REDIS_CLUSTER_URLS",
            RedisNodes::Sentinel { .. } => "REDIS_SENTINEL_URLS",
        }
    }

    /// The URLs configured: the node, the seeds, or the sentinels.
    pub(super) fn urls(&self) -> &[String] {
        match self {
            RedisNodes::Single(u) => std::slice::from_ref(u),
            RedisNodes::Cluster(s) => s,
            RedisNodes::Sentinel { sentinels, .. } => sentinels,
        }
    }
}
