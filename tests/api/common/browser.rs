//! A real, headless Chromium driven over the W3C WebDriver protocol (Debian's
//! `chromium` and `chromium-driver`, which `scripts/test` installs), spoken with reqwest:
//! no WebDriver crate needed for navigate, run a script, resize, screenshot, read the
//! console.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::faults::free_port;

pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
}

impl Browser {
    /// Starts chromedriver on a spare loopback port and opens a headless session.
    pub async fn start() -> Self {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .args([format!("--port={port}"), "--allowed-ips=127.0.0.1".into()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver; scripts/test installs it)");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = match http.get(format!("{base}/status")).send().await {
                Ok(r) => r.json::<Value>().await.ok(),
                Err(_) => None,
            };
            if ready.is_some_and(|v| v["value"]["ready"] == true) {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium(),
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let reply: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = reply["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {reply}"))
            .to_string();
        Self {
            driver,
            base,
            session,
            http,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let reply: Value = req.send().await.unwrap().json().await.unwrap();
        assert!(
            reply["value"].get("error").is_none(),
            "webdriver {path}: {reply}"
        );
        reply["value"].clone()
    }

    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body: `return …`) in the page.
    pub async fn eval(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Evaluates `script` until `ok` holds for its result (at most `limit`); the result.
    pub async fn wait_for(
        &self,
        script: &str,
        limit: Duration,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.eval(script).await;
            if ok(&value) {
                return value;
            }
            assert!(
                Instant::now() < deadline,
                "{script} never held within {limit:?}: last {value}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn resize(&self, width: u32, height: u32) {
        self.call(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        )
        .await;
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine as _;
        let png = self.call(reqwest::Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap()
    }

    /// The console's entries since the last call (`level`, `message`).
    pub async fn console(&self) -> Vec<Value> {
        let logs = self
            .call(
                reqwest::Method::POST,
                "/se/log",
                Some(json!({"type": "browser"})),
            )
            .await;
        logs.as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Deleting the session ends Chromium (a killed driver would leave it running):
        // a plain blocking request, as Drop cannot await.
        use std::io::{Read, Write};
        let host = self.base.trim_start_matches("http://");
        if let Ok(mut tcp) = std::net::TcpStream::connect(host) {
            let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = write!(
                tcp,
                "DELETE /session/{} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
                self.session
            );
            let _ = tcp.read_to_end(&mut Vec::new());
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn chromium() -> &'static str {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("chromium (Debian's package; scripts/test installs it)")
}
