//! The API document as its users meet it: a client generated from the live
//! `/openapi.json` by a mainstream generator (openapi-python-client, through
//! `scripts/generate-client`) drives the whole flow (`tests/api/client_flow.py`).

use std::path::Path;
use std::process::Stdio;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::common::TestApp;

/// What `scripts/generate-client` exits with when python3 cannot make a venv at all.
const NO_VENV: i32 = 3;

#[sqlx::test(migrator = "seckill::MIGRATOR")]
async fn a_client_generated_from_the_api_document_runs_the_whole_flow(db: PgPool) {
    let app = TestApp::spawn(db).await;
    // The worker writes admitted orders, as `seckill serve` does beside the API.
    let cancel = CancellationToken::new();
    let worker = tokio::spawn(app.worker().run(cancel.clone()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempdir();

    let generated = tokio::process::Command::new(root.join("scripts/generate-client"))
        .arg(&app.base)
        .arg(&out)
        .stderr(Stdio::inherit())
        .output()
        .await
        .expect("run scripts/generate-client");
    if generated.status.code() == Some(NO_VENV) {
        eprintln!(
            "SKIPPED a_client_generated_from_the_api_document_runs_the_whole_flow: python3 \
             cannot create a venv here (see scripts/generate-client's message above)"
        );
        return;
    }
    assert!(generated.status.success(), "scripts/generate-client failed");
    let stdout = String::from_utf8(generated.stdout).unwrap();
    let python = stdout.lines().last().expect("the venv's python").trim();

    let shoppers = [1001, 1002, 1003].map(|user| app.token(user)).join(",");
    let flow = tokio::process::Command::new(python)
        .arg(root.join("tests/api/client_flow.py"))
        .env("PYTHONPATH", &out)
        .env("SECKILL_BASE", &app.base)
        .env("SECKILL_ADMIN", app.admin_token())
        .env("SECKILL_SHOPPERS", shoppers)
        .env("SECKILL_STAFF", app.staff_token(3001, 7))
        .env("SECKILL_PAYMENT_SECRET", crate::common::PAYMENT_SECRET)
        .output();
    let flow = tokio::time::timeout(std::time::Duration::from_secs(120), flow)
        .await
        .expect("the flow finishes within 2 minutes")
        .expect("run the flow");
    let printed = String::from_utf8_lossy(&flow.stdout);
    println!("{printed}");
    eprintln!("{}", String::from_utf8_lossy(&flow.stderr));
    assert!(flow.status.success(), "the generated client's flow failed");
    assert_eq!(printed.lines().last(), Some("flow ok"));

    cancel.cancel();
    worker.await.unwrap();
    let _ = std::fs::remove_dir_all(&out);
}

/// A fresh directory for the generated package.
fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "seckill-client-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
