//! Unit tests: settings as clap reads them.

use super::*;

fn skip_migrations(args: &[&str]) -> Result<bool, clap::Error> {
    let base = [
        "seckill",
        "api",
        "--database-url",
        "postgres://x",
        "--jwt-secret",
        "s",
    ];
    let cli = Cli::try_parse_from(base.iter().chain(args))?;
    match cli.command {
        Command::Api(api) => Ok(api.skip_migrations),
        _ => unreachable!(),
    }
}

#[test]
fn no_secret_of_any_command_shows_when_its_settings_are_printed() {
    let secrets = [
        "--jwt-secret=hs256-key-7f3a",
        "--database-url=postgres://app:db-pass-9c1e@db:5432/shop",
        "--redis-url=redis://:redis-pass-4b2d@cache:6379",
    ];
    let cluster = "--redis-cluster-urls=redis://:seed-pass-1@a:7000,redis://:seed-pass-2@b:7001";
    let commands: [&[&str]; 6] = [
        &["serve", secrets[0], secrets[1], secrets[2], cluster],
        &[
            "api",
            secrets[0],
            secrets[1],
            "--redis-pubsub-url=redis://:seed-pass-3@h",
        ],
        &[
            "api",
            secrets[1],
            "--jwt-jwks-url=https://svc:seed-pass-4@idp.example/jwks",
        ],
        &["worker", secrets[1], secrets[2]],
        &["token", secrets[0], "--user", "1"],
        &["demo", secrets[0]],
    ];
    for args in commands {
        let cli = Cli::try_parse_from(std::iter::once("seckill").chain(args.iter().copied()));
        let printed = format!("{:?}", cli.unwrap_or_else(|e| panic!("{args:?}: {e}")));
        for leak in [
            "hs256-key-7f3a",
            "db-pass-9c1e",
            "redis-pass-4b2d",
            "seed-pass",
        ] {
            assert!(
                !printed.contains(leak),
                "{args:?} printed {leak}: {printed}"
            );
        }
        assert!(printed.contains("***"), "{args:?}: {printed}");
    }
}

#[test]
fn skip_migrations_accepts_one_zero_true_and_false_in_any_case() {
    assert!(!skip_migrations(&[]).unwrap());
    assert!(skip_migrations(&["--skip-migrations"]).unwrap());
    for yes in ["1", "true", "TRUE", "True", "yes", "on"] {
        let arg = format!("--skip-migrations={yes}");
        assert!(skip_migrations(&[&arg]).unwrap(), "{yes}");
    }
    for no in ["0", "false", "FALSE", "no", "off"] {
        let arg = format!("--skip-migrations={no}");
        assert!(!skip_migrations(&[&arg]).unwrap(), "{no}");
    }
    assert!(skip_migrations(&["--skip-migrations=maybe"]).is_err());
    // The environment, in the same test so that no other parse sees the variable.
    std::env::set_var("SKIP_MIGRATIONS", "1");
    let parsed = skip_migrations(&[]);
    std::env::remove_var("SKIP_MIGRATIONS");
    assert!(parsed.unwrap());
}

#[test]
fn a_consumer_name_may_not_contain_the_lane_separator() {
    assert!(super::consumer_name("worker-eu.1").is_ok());
    for bad in ["", "a/b", "a b", "a\nb", &"x".repeat(201)] {
        assert!(super::consumer_name(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn cors_origins_are_scheme_host_and_port_only() {
    assert_eq!(
        super::origin(" https://Shop.example.com:8443").unwrap(),
        "https://shop.example.com:8443"
    );
    assert!(super::origin("http://localhost:3000").is_ok());
    assert_eq!(super::origin("https://a.com:443").unwrap(), "https://a.com");
    assert_eq!(super::origin("http://a.com:80").unwrap(), "http://a.com");
    assert_eq!(super::origin("").unwrap(), "");
    for bad in [
        "*",
        "shop.example.com",
        "https://",
        "https://a.com/",
        "https://a.com/x",
        "ftp://a.com",
        "https://a b",
    ] {
        assert!(super::origin(bad).is_err(), "{bad:?}");
    }
}
