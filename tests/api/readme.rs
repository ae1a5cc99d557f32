//! The README's five-minute walk-through, run as written against the real `seckill
//! serve`: every command in its `sh` blocks, in order, in one shell, each answer held to
//! the one the README shows under it. `docker compose exec -T seckill seckill` is this
//! build's binary, `localhost:8080` the test's server; nothing else is changed.

use std::path::Path;
use std::process::Command;

use sqlx::PgPool;

use crate::common::faults::BIN;
use crate::common::{TestApp, PAYMENT_SECRET, SECRET};

const SECTION: &str = "## A five-minute walk-through";

/// A run of command lines, and the answer lines the README shows after them.
struct Step {
    commands: Vec<String>,
    shown: Vec<String>,
}

/// Whether a comment line is a shown answer (`# {...} 409`, `# voucher 1`), not a remark.
fn answer(line: &str) -> Option<&str> {
    let text = line.strip_prefix("# ")?;
    ["{", "[", "voucher ", "order "]
        .iter()
        .any(|p| text.starts_with(p))
        .then_some(text)
}

/// The walk-through's `sh` blocks as steps, and its plain blocks (printed output).
fn walk_through(readme: &str) -> (Vec<Step>, Vec<String>) {
    let start = readme.find(SECTION).expect("the walk-through section");
    let rest = &readme[start + SECTION.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let (mut steps, mut printed) = (Vec::new(), Vec::new());
    let mut fence: Option<&str> = None;
    for line in section.lines() {
        match (fence, line.strip_prefix("```")) {
            (None, Some(lang)) => fence = Some(lang),
            (Some(_), Some(_)) => fence = None,
            (Some("sh"), None) => match answer(line) {
                Some(text) => match steps.last_mut() {
                    Some(Step { shown, .. }) => shown.push(text.to_string()),
                    None => panic!("an answer before any command: {line}"),
                },
                None => {
                    let open = steps.last().is_some_and(|s: &Step| s.shown.is_empty());
                    if !open {
                        steps.push(Step {
                            commands: Vec::new(),
                            shown: Vec::new(),
                        });
                    }
                    steps.last_mut().unwrap().commands.push(line.to_string());
                }
            },
            (Some(_), None) => printed.push(line.to_string()),
            (None, None) => {}
        }
    }
    (steps, printed)
}

/// A shown answer as an extended regular expression: `...` stands for anything, order
/// ids and times for any of their kind.
fn pattern(shown: &str) -> String {
    let mut out = String::new();
    let mut rest = shown;
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("...") {
            out.push_str(".*");
            rest = &rest[3..];
            continue;
        }
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits >= 15 {
            out.push_str("[0-9]+");
            rest = &rest[digits..];
            continue;
        }
        if digits == 4 && rest.as_bytes().get(4) == Some(&b'-') {
            // An RFC 3339 time: up to the closing quote.
            let end = rest.find('"').unwrap_or(rest.len());
            out.push_str("[^\"]+");
            rest = &rest[end..];
            continue;
        }
        if "\\^$.|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The script: the README's commands, each answer checked (a command without an
/// assignment is repeated for up to five seconds while its answer differs: an order
/// is `pending` until the worker has written it, as a person typing would not notice).
fn script(steps: &[Step], dir: &Path, addr: &str) -> String {
    let mut s = format!(
        "set -u\n\
         docker() {{\n  local all=\"$*\"\n  [ \"${{all#compose exec -T seckill seckill }}\" != \"$all\" ] || exit 97\n  \
         shift 5; JWT_SECRET='{SECRET}' PAYMENT_WEBHOOK_SECRETS='{PAYMENT_SECRET}' BIND='{addr}' '{BIN}' \"$@\"\n}}\n"
    );
    for (i, step) in steps.iter().enumerate() {
        let commands = step.commands.join("\n").replace("localhost:8080", addr);
        if step.shown.is_empty() {
            s.push_str(&format!("{commands}\n"));
            continue;
        }
        let (out, re) = (dir.join(format!("out-{i}")), dir.join(format!("re-{i}")));
        let lines: Vec<String> = step.shown.iter().map(|l| pattern(l)).collect();
        std::fs::write(&re, lines.join("\n") + "\n").unwrap();
        let tries = if commands.contains("=$(") { 1 } else { 50 };
        s.push_str(&format!(
            "for try in $(seq {tries}); do\n{{\n{commands}\n}} >'{out}' 2>&1\n\
             [ \"$(grep -cxEf '{re}' '{out}')\" -ge {n} ] && break; sleep 0.1\ndone\n\
             [ \"$(grep -cxEf '{re}' '{out}')\" -ge {n} ] || \
             {{ printf 'step %s answered:\\n' {i}; cat '{out}'; exit 1; }}\n",
            out = out.display(),
            re = re.display(),
            n = lines.len(),
        ));
    }
    s
}

#[sqlx::test(migrations = false)]
async fn the_readmes_walk_through_runs_as_written_and_answers_as_shown(db: PgPool) {
    let app = TestApp::spawn(db.clone()).await;
    let (_server, base) = app
        .spawn_server("serve", &[("WORKER_BLOCK_MS", "100".to_string())])
        .await;
    let addr = base.trim_start_matches("http://").to_string();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let (steps, printed) = walk_through(&readme);
    let checked = steps.iter().filter(|s| !s.shown.is_empty()).count();
    assert!(
        checked >= 10,
        "only {checked} answers shown in the walk-through"
    );

    let dir = std::env::temp_dir().join(format!(
        "seckill-readme-{}",
        app.keys.prefix().trim_end_matches(':')
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let script = script(&steps, &dir, &addr);
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash").args(["-c", &script]).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{stdout}\n{stderr}");

    // The demo's table, as shown: each row's name and figure (rows with `...` skipped).
    for row in printed.iter().filter(|l| !l.contains("...")) {
        let words: Vec<&str> = row.split_whitespace().take(2).collect();
        let found = stdout
            .lines()
            .any(|l| l.split_whitespace().take(2).collect::<Vec<_>>() == words);
        assert!(
            found,
            "the demo printed no `{}` row:\n{stdout}",
            words.join(" ")
        );
    }
}

#[test]
fn a_shown_answer_matches_any_ids_and_times_but_nothing_else() {
    let re = pattern(
        r#"{"order_id":"119147651799191552",...,"pay_before":"2026-11-25T19:00:13.845Z"} 200"#,
    );
    assert_eq!(re, r#"\{"order_id":"[0-9]+",.*,"pay_before":"[^"]+"\} 200"#);
    let (steps, printed) = walk_through(
        "## A five-minute walk-through\n```sh\nX=1\n# voucher 1\ny\n```\n```\nadmitted 1\n```\n## Next\n```sh\nz\n```",
    );
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].commands, ["X=1"]);
    assert_eq!(steps[0].shown, ["voucher 1"]);
    assert_eq!(steps[1].commands, ["y"]);
    assert_eq!(printed, ["admitted 1"]);
}
