//! The documentation held to the code: `docs/configuration.md` lists exactly the settings
//! the binary's `--help` prints, each with the subcommands that read it;
//! `docs/operations.md` lists every metric; and the pages link only to files and
//! headings that exist, never outside the repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::common::faults::BIN;

/// Every subcommand of `seckill` (a test below holds this list to `seckill --help`).
const SUBCOMMANDS: &[&str] = &[
    "serve",
    "api",
    "worker",
    "migrate",
    "token",
    "notify",
    "reconcile",
    "dead-letters",
    "demo",
];

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn help(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .arg("--help")
        .output()
        .expect("run seckill --help");
    assert!(out.status.success(), "seckill {args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The names after every `[env: ` of a help text (`[env: NAME=value]` or `[env: NAME]`).
fn env_names(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// Setting → the subcommands whose `--help` prints it.
fn settings_in_help() -> BTreeMap<String, BTreeSet<String>> {
    let mut settings: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for sub in SUBCOMMANDS {
        for name in env_names(&help(&[sub])) {
            settings.entry(name).or_default().insert(sub.to_string());
        }
    }
    settings
}

/// The `` `UPPER_CASE` `` names in a piece of Markdown.
fn upper_case_names(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.len() > 1
                && s.starts_with(|c: char| c.is_ascii_uppercase())
                && s.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_string)
        .collect()
}

/// The rows of the Markdown tables of `doc` whose first cell names settings: each
/// setting with the second cell ("read by": subcommands, or `all`).
fn documented_settings(doc: &str) -> Vec<(String, String)> {
    doc.lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let names = upper_case_names(cells.first()?);
            let read_by = cells.get(1).copied().unwrap_or("").to_string();
            Some(names.into_iter().map(move |n| (n, read_by.clone())))
        })
        .flatten()
        .collect()
}

#[test]
fn the_subcommand_list_is_the_one_the_binary_prints() {
    let top = help(&[]);
    let listed: BTreeSet<String> = top
        .split("Commands:")
        .nth(1)
        .expect("a Commands: section")
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect();
    let ours: BTreeSet<String> = SUBCOMMANDS.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        listed, ours,
        "a subcommand was added or removed: update SUBCOMMANDS"
    );
    let doc = read("docs/configuration.md");
    for sub in SUBCOMMANDS {
        assert!(
            doc.contains(&format!("`seckill {sub}")),
            "docs/configuration.md does not mention `seckill {sub}`"
        );
    }
}

#[test]
fn every_setting_in_help_is_documented_and_every_documented_setting_exists() {
    let in_help = settings_in_help();
    assert!(in_help.len() >= 40, "too few settings found: {in_help:?}");
    let doc = read("docs/configuration.md");
    let documented: BTreeSet<String> = documented_settings(&doc)
        .into_iter()
        .map(|(name, _)| name)
        .collect();

    let missing: Vec<&String> = in_help
        .keys()
        .filter(|name| !documented.contains(*name))
        .collect();
    assert!(
        missing.is_empty(),
        "settings `seckill <subcommand> --help` prints but docs/configuration.md's tables \
         do not list as `NAME`: {missing:?}"
    );
    let made_up: Vec<&String> = documented
        .iter()
        .filter(|name| !in_help.contains_key(*name))
        .collect();
    assert!(
        made_up.is_empty(),
        "settings docs/configuration.md's tables list that no --help prints: {made_up:?}"
    );
}

#[test]
fn each_documented_setting_names_exactly_the_subcommands_that_read_it() {
    let in_help = settings_in_help();
    let doc = read("docs/configuration.md");
    let mut rows = 0;
    for (name, read_by) in documented_settings(&doc) {
        rows += 1;
        let said: BTreeSet<String> = if read_by == "all" {
            SUBCOMMANDS.iter().map(|s| s.to_string()).collect()
        } else {
            read_by
                .split(',')
                .map(|s| s.trim().trim_matches('`').to_string())
                .collect()
        };
        let Some(actual) = in_help.get(&name) else {
            continue; // the test above says so
        };
        assert_eq!(
            &said, actual,
            "docs/configuration.md says `{name}` is read by {said:?}; --help says {actual:?}"
        );
    }
    assert!(rows >= 40, "too few setting rows: {rows}");
}

#[test]
fn every_metric_is_in_the_operations_guide() {
    let source = read("src/metrics.rs");
    let metrics: Vec<&str> = source
        .lines()
        .filter_map(|l| l.strip_prefix("pub(crate) const "))
        .filter_map(|l| l.split_once(": &str = \"")?.1.strip_suffix("\";"))
        .collect();
    assert!(metrics.len() >= 21, "{metrics:?}");
    let doc = read("docs/operations.md");
    for metric in metrics {
        assert!(
            doc.contains(&format!("| `{metric}` |")),
            "docs/operations.md's metrics table has no row for `{metric}`"
        );
    }
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut found = BTreeSet::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            found.insert(anchor(line.trim_start_matches('#')));
        }
    }
    found
}

/// The targets of the inline links `[text](target)` of a Markdown text, code left out.
fn links(markdown: &str) -> Vec<String> {
    let mut in_code = false;
    let mut found = Vec::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Inline code may hold brackets that are not links.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        for (i, _) in prose.match_indices("](") {
            let rest = &prose[i + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_string());
            }
        }
    }
    found
}

#[test]
fn the_pages_link_only_to_files_and_headings_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![
        "README.md".to_string(),
        "load/README.md".to_string(),
        "load/oha.md".to_string(),
    ];
    for dir in ["docs", "load/results"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".md") {
                pages.push(format!("{dir}/{name}"));
            }
        }
    }
    let mut checked = 0;
    for page in &pages {
        let text = read(page);
        let dir = Path::new(page).parent().unwrap();
        for target in links(&text) {
            if target.starts_with("http://") || target.starts_with("https://") {
                assert!(
                    !page.starts_with("docs/"),
                    "{page} links outside the repository: {target}"
                );
                continue;
            }
            let (file, fragment) = match target.split_once('#') {
                Some((file, fragment)) => (file, Some(fragment)),
                None => (target.as_str(), None),
            };
            let path = if file.is_empty() {
                root.join(page)
            } else {
                root.join(dir).join(file)
            };
            assert!(
                path.exists(),
                "{page} links to {target}, which does not exist"
            );
            if let Some(fragment) = fragment {
                let linked = std::fs::read_to_string(&path).unwrap();
                assert!(
                    anchors(&linked).contains(fragment),
                    "{page} links to {target}: no such heading"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "too few links checked: {checked}");
}
