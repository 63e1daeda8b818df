//! No module of any workspace crate imports another in a loop (issue 15): the files of a crate
//! form a directed acyclic graph under "names an item of", so each can be read after the ones it
//! uses. An edge runs from a file to the module file that a `crate::…` or `super::…` path in its
//! code resolves to (the longest prefix that is a module file). Not edges: comment lines,
//! `#[cfg(test)] mod … { … }` blocks (tests may use anything), paths to the crate root
//! (`lib.rs` only declares modules and re-exports), and a module's paths into its own
//! submodules (a parent holds its children).
//!
//! `cargo test --release -p deltafin --test module_loops` prints every loop it finds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `(crate directory name, module path)`: `("deltafin-engine", ["experts", "cache"])`.
type Module = (String, Vec<String>);

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of `file` under `src`: `lib.rs` is `[]`, `a/mod.rs` and `a.rs` are `[a]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut segs: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(segs.last().map(String::as_str), Some("lib" | "main" | "mod")) {
        segs.pop();
    }
    segs
}

/// `text` without comment lines and without `#[cfg(test)]` inline modules.
fn code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with("//")).collect();
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        let next = lines.get(i + 1).map(|l| l.trim_start()).unwrap_or("");
        let test_mod = lines[i].trim() == "#[cfg(test)]"
            && ["mod ", "pub mod ", "pub(crate) mod "]
                .iter()
                .any(|p| next.starts_with(p))
            && next.trim_end().ends_with('{');
        if test_mod {
            i += 1;
            let mut depth = 0i64;
            while i < lines.len() {
                depth += lines[i].matches('{').count() as i64 - lines[i].matches('}').count() as i64;
                i += 1;
                if depth <= 0 {
                    break;
                }
            }
            continue;
        }
        out.push_str(lines[i]);
        out.push('\n');
        i += 1;
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifiers of one `a::b::c` path (each piece cut at its first non-identifier character).
fn idents(path: &str) -> Vec<String> {
    path.split("::")
        .map(|s| s.trim().chars().take_while(|&c| is_ident(c)).collect::<String>())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The absolute paths that `code` names through `crate::…` and `super::…` from module `here`
/// (a `{a::X, b}` group gives one path per member).
fn named_paths(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    let mut prev = ' ';
    while let Some(at) = rest.find(['c', 's']) {
        let before = if at == 0 {
            prev
        } else {
            rest[..at].chars().last().unwrap()
        };
        let tail = &rest[at..];
        let base = ["crate::", "super::"].into_iter().find(|k| tail.starts_with(k));
        let Some(base) = base.filter(|_| !is_ident(before)) else {
            prev = tail.chars().next().unwrap();
            rest = &tail[prev.len_utf8()..];
            continue;
        };
        let mut start: Vec<String> = if base == "crate::" {
            Vec::new()
        } else {
            here[..here.len().saturating_sub(1)].to_vec()
        };
        let after = &tail[base.len()..];
        let end = after.find(|c: char| !(is_ident(c) || c == ':')).unwrap_or(after.len());
        let mut segs = idents(&after[..end]);
        while segs.first().is_some_and(|s| s == "super") {
            segs.remove(0);
            start.pop();
        }
        start.extend(segs);
        if after[end..].starts_with('{') {
            let mut depth = 0;
            let mut member = String::new();
            let mut members = Vec::new();
            for c in after[end + 1..].chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        members.push(std::mem::take(&mut member));
                        continue;
                    }
                    _ => {}
                }
                member.push(c);
            }
            members.push(member);
            for m in members {
                let mut p = start.clone();
                p.extend(idents(&m));
                paths.push(p);
            }
        } else {
            paths.push(start);
        }
        prev = ':';
        rest = &after[end..];
    }
    paths
}

#[test]
fn no_module_imports_another_in_a_loop() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files: BTreeMap<Module, PathBuf> = BTreeMap::new();
    for e in std::fs::read_dir(crates).unwrap() {
        let dir = e.unwrap().path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut rs = Vec::new();
        rs_files(&src, &mut rs);
        for f in rs {
            files.insert((name.clone(), module_path(&src, &f)), f);
        }
    }
    assert!(
        files.len() > 50,
        "found only {} source files under {}",
        files.len(),
        crates.display()
    );
    let mut edges: BTreeMap<&Module, BTreeSet<&Module>> = BTreeMap::new();
    for (m, f) in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for p in named_paths(&code(&text), &m.1) {
            let target = (1..=p.len())
                .rev()
                .map(|k| (m.0.clone(), p[..k].to_vec()))
                .find_map(|k| files.get_key_value(&k).map(|(k, _)| k));
            if let Some(t) = target {
                if !t.1.starts_with(&m.1) {
                    edges.entry(m).or_default().insert(t);
                }
            }
        }
    }
    let reach = |from: &Module| -> BTreeSet<&Module> {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&Module> = edges.get(from).into_iter().flatten().copied().collect();
        while let Some(x) = stack.pop() {
            if seen.insert(x) {
                stack.extend(edges.get(x).into_iter().flatten().copied());
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<&Module>> = files.keys().map(|m| (m, reach(m))).collect();
    let mut loops: Vec<Vec<String>> = Vec::new();
    let mut placed = BTreeSet::new();
    for m in files.keys() {
        if placed.contains(m) || !reached[m].contains(m) {
            continue;
        }
        let members: Vec<&Module> = files
            .keys()
            .filter(|o| reached[m].contains(o) && reached[o].contains(m))
            .collect();
        placed.extend(members.iter().copied());
        loops.push(
            members
                .iter()
                .map(|o| files[*o].strip_prefix(crates).unwrap().display().to_string())
                .collect(),
        );
    }
    assert!(loops.is_empty(), "modules importing each other in a loop: {loops:#?}");
}

/// The resolver itself: grouped imports, `super::`, and comments are read as intended.
#[test]
fn named_paths_reads_groups_super_and_skips_comments() {
    let here = vec!["experts".to_string(), "cache".to_string()];
    let src = "use crate::model::{CausalLm, speculate::MAX_DRAFT};\nlet k = super::Key::new();\n// crate::ignored::X\nfn f() -> crate::a::B { my_crate::x::Y }\n";
    let paths = named_paths(&code(src), &here);
    let want: Vec<Vec<&str>> = vec![
        vec!["model", "CausalLm"],
        vec!["model", "speculate", "MAX_DRAFT"],
        vec!["experts", "Key", "new"],
        vec!["a", "B"],
    ];
    assert_eq!(paths, want);
    let stripped = code("fn a() {}\n#[cfg(test)]\nmod tests {\n    use crate::x::Y;\n}\nfn b() {}\n");
    assert_eq!(stripped, "fn a() {}\nfn b() {}\n");
}
