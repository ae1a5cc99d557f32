//! Unit tests: which Redis the settings name.

use super::*;

fn target(
    cluster: &[&str],
    sentinels: &[&str],
    master: Option<&str>,
) -> anyhow::Result<RedisTarget> {
    let owned = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    RedisTarget::new(
        crate::config::DEFAULT_REDIS_URL,
        &owned(cluster),
        SentinelArgs {
            urls: &owned(sentinels),
            master,
        },
        None,
    )
}

fn error(result: anyhow::Result<RedisTarget>) -> String {
    result.map(|_| ()).unwrap_err().to_string()
}

#[test]
fn sentinels_and_a_master_name_make_a_sentinel_target() {
    let t = target(
        &[],
        &["redis://127.0.0.1:26379", " redis://h:26380 ", ""],
        Some("m"),
    )
    .unwrap();
    match t.nodes {
        RedisNodes::Sentinel { sentinels, master } => {
            assert_eq!(sentinels, ["redis://127.0.0.1:26379", "redis://h:26380"]);
            assert_eq!(master, "m");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn sentinel_urls_without_a_master_name_are_refused_naming_both_settings() {
    let e = error(target(&[], &["redis://127.0.0.1:26379"], None));
    assert!(
        e.contains("REDIS_SENTINEL_URLS is set but REDIS_SENTINEL_MASTER is not"),
        "{e}"
    );
    let e = error(target(&[], &["redis://127.0.0.1:26379"], Some("  ")));
    assert!(e.contains("REDIS_SENTINEL_MASTER is not"), "{e}");
}

#[test]
fn a_master_name_without_sentinel_urls_is_refused() {
    let e = error(target(&[], &[], Some("mymaster")));
    assert!(
        e.contains("REDIS_SENTINEL_MASTER is set but REDIS_SENTINEL_URLS is not"),
        "{e}"
    );
}

#[test]
fn sentinel_and_cluster_together_are_refused() {
    let e = error(target(
        &["redis://127.0.0.1:7000"],
        &["redis://127.0.0.1:26379"],
        Some("m"),
    ));
    assert!(
        e.contains("REDIS_SENTINEL_URLS and REDIS_CLUSTER_URLS are both set"),
        "{e}"
    );
}

#[test]
fn sentinel_urls_must_all_speak_tls_or_none() {
    let e = error(target(
        &[],
        &["redis://127.0.0.1:1", "rediss://127.0.0.1:2"],
        Some("m"),
    ));
    assert!(
        e.contains("REDIS_SENTINEL_URLS: either every URL is rediss:// (TLS) or none is"),
        "{e}"
    );
}

#[test]
fn a_sentinel_url_must_be_a_redis_url() {
    let e = error(target(&[], &["http://user:secret@127.0.0.1:1"], Some("m")));
    assert!(
        e.contains("REDIS_SENTINEL_URLS: http://user:***@127.0.0.1:1/ is not a redis://"),
        "{e}"
    );
}

#[test]
fn a_ca_file_without_tls_names_the_sentinel_setting() {
    let owned = vec!["redis://127.0.0.1:26379".to_string()];
    let e = error(RedisTarget::new(
        crate::config::DEFAULT_REDIS_URL,
        &[],
        SentinelArgs {
            urls: &owned,
            master: Some("m"),
        },
        Some(std::path::Path::new("/nonexistent.pem")),
    ));
    assert!(
        e.contains("REDIS_SENTINEL_URLS is not a rediss:// URL"),
        "{e}"
    );
}
