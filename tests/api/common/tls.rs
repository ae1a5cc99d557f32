//! TLS servers of the test's own: certificates made with `openssl`, a private Postgres
//! that accepts only TLS connections (`hostssl` in pg_hba), and a `redis-server` that
//! listens only on a `--tls-port`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::faults::free_port;

/// A CA, a server certificate it signed (for `localhost` and 127.0.0.1, not 127.0.0.2),
/// and a second CA that signed nothing the servers present.
pub struct Certs {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl on PATH");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn scratch_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "seckill-{what}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Certs {
    pub fn make() -> Self {
        let dir = scratch_dir("certs");
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (name, cn) in [("ca", "seckill test CA"), ("other-ca", "someone else's CA")] {
            let (key, pem, subj) = (
                format!("{name}.key"),
                format!("{name}.pem"),
                format!("/CN={cn}"),
            );
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
            args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(&dir, &args);
        }
        let mut args = vec!["req"];
        args.extend(ec);
        args.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        openssl(&dir, &args);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap();
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
        );
        Self {
            ca: dir.join("ca.pem"),
            other_ca: dir.join("other-ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            dir,
        }
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Postgres refuses to run as root: as root, run its programs as the `postgres` account.
fn as_postgres(program: &Path) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if root {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// The newest installed Postgres's programs (Debian's layout), else those on PATH.
fn pg_bin(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.into_iter()
        .rev()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// A private Postgres on 127.0.0.1 and 127.0.0.2 that accepts TLS connections only.
pub struct TlsPostgres {
    pub port: u16,
    data: PathBuf,
    dir: PathBuf,
}

impl TlsPostgres {
    pub fn start(certs: &Certs) -> Self {
        let dir = scratch_dir("tls-postgres");
        let data = dir.join("data");
        let port = free_port();
        std::fs::copy(&certs.server_cert, dir.join("server.pem")).unwrap();
        std::fs::copy(&certs.server_key, dir.join("server.key")).unwrap();
        let _ = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(&dir)
            .status();
        let status = as_postgres(&pg_bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync"])
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(status.success(), "initdb failed");
        // TLS or nothing, from any loopback address.
        std::fs::write(
            data.join("pg_hba.conf"),
            "hostssl all all 127.0.0.0/8 trust\n",
        )
        .unwrap();
        std::fs::set_permissions(
            dir.join("server.key"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        let options = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1,127.0.0.2 -c fsync=off \
             -c ssl=on -c ssl_cert_file={dir}/server.pem -c ssl_key_file={dir}/server.key",
            dir = dir.display()
        );
        let status = as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("postgres.log"))
            .args(["-w", "-o", &options, "start"])
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctl");
        assert!(
            status.success(),
            "postgres did not start: {}",
            std::fs::read_to_string(dir.join("postgres.log")).unwrap_or_default()
        );
        Self { port, data, dir }
    }

    /// `DATABASE_URL` for `host`, with the given TLS parameters.
    pub fn url(&self, host: &str, tls: &str) -> String {
        format!("postgres://postgres@{host}:{}/postgres?{tls}", self.port)
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let _ = as_postgres(&pg_bin("pg_ctl"))
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Arguments that make a `redis-server` speak TLS only, on `port`.
pub fn redis_tls_args(certs: &Certs, port: u16) -> Vec<String> {
    let path = |p: &Path| p.display().to_string();
    vec![
        "--port".into(),
        "0".into(),
        "--tls-port".into(),
        port.to_string(),
        "--tls-cert-file".into(),
        path(&certs.server_cert),
        "--tls-key-file".into(),
        path(&certs.server_key),
        "--tls-ca-cert-file".into(),
        path(&certs.ca),
        "--tls-auth-clients".into(),
        "no".into(),
    ]
}

/// A redis-rs client that trusts the test's CA.
pub fn redis_client(url: &str, certs: &Certs) -> redis::Client {
    redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(&certs.ca).unwrap()),
        },
    )
    .unwrap()
}

/// A Redis that listens only on a TLS port of 127.0.0.1.
pub struct TlsRedis {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl TlsRedis {
    pub fn start(certs: &Certs) -> Self {
        let port = free_port();
        let dir = scratch_dir("tls-redis");
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(redis_tls_args(certs, port))
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let redis = Self { child, port, dir };
        let client = redis_client(&redis.url("localhost"), certs);
        let deadline = Instant::now() + Duration::from_secs(10);
        while client
            .get_connection()
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_err()
        {
            assert!(Instant::now() < deadline, "TLS redis did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    pub fn url(&self, host: &str) -> String {
        format!("rediss://{host}:{}", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
