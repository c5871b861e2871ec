//! The modules of `baton-messages`, `baton-ipc` and `baton-actors` form layers: each
//! crate's `lib.rs` declares its modules bottom first, and each may use only the modules
//! declared above it — so no two modules use each other, directly or around a cycle (see
//! "Layers" in each crate's docs). One test per crate, one checker for all three. Below
//! them, no two *files* of a crate (or of `benches/handoff`) use each other around a cycle
//! either (the "Files" part at the end).
//!
//! The check reads the sources: every `crate::x` path (also `$crate::x`, and each entry
//! of `use crate::{x, y::z}`), and every `super::` path that climbs to the crate root from
//! a nested module (an inline `mod` or a file under `src/<module>/`), names a module of
//! the crate — directly, or through one of `lib.rs`'s re-exports (`crate::Node` is
//! `node`'s), or an item `lib.rs` defines itself (`crate::Result`: any module may use
//! those). Comments (doc comments too) and string literals are not code and are
//! skipped. What it cannot see is a method call on a type whose `impl` sits in a higher
//! module; the layers keep those in order too, by review — and for `baton-actors`'s
//! `Node`, by its types: below the node tree a module holds a `NodeCore`, never a `Node`,
//! and every inherent `impl Node` is in that tree (the "Node tree" part at the end).

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

/// Rust source as tokens with their line numbers, without comments, string, byte and
/// char literals.
fn tokens(src: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Skips to just past the `"` that ends a string whose body starts at `i`; with
    // `hashes`, a raw string ending in `"` and that many `#`.
    let skip_string = |mut i: usize, hashes: Option<usize>, line: &mut usize| -> usize {
        while i < chars.len() {
            match chars[i] {
                '\n' => *line += 1,
                '\\' if hashes.is_none() => {
                    if chars.get(i + 1) == Some(&'\n') {
                        *line += 1;
                    }
                    i += 1;
                }
                '"' => {
                    let n = hashes.unwrap_or(0);
                    if chars[i + 1..].iter().take(n).filter(|c| **c == '#').count() == n {
                        return i + 1 + n;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        i
    };
    // Skips the char literal whose `'` is at `i` (`'x'`, `'\n'`, `'\u{1F600}'`); `None`
    // for a lifetime or a label.
    let skip_char = |i: usize| -> Option<usize> {
        if chars.get(i + 1) == Some(&'\\') {
            let mut j = i + 3;
            while j < chars.len() && chars[j] != '\'' {
                j += 1;
            }
            Some(j + 1)
        } else if chars.get(i + 2) == Some(&'\'') {
            Some(i + 3)
        } else {
            None
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '\n' => {
                line += 1;
                i += 1;
            }
            c if c.is_whitespace() => i += 1,
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if next == Some('*') => {
                let mut depth = 0;
                while i < chars.len() {
                    if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if chars[i] == '\n' {
                            line += 1;
                        }
                        i += 1;
                    }
                }
            }
            '"' => i = skip_string(i + 1, None, &mut line),
            '\'' => i = skip_char(i).unwrap_or(i + 1),
            ':' if next == Some(':') => {
                out.push((Token::PathSep, line));
                i += 2;
            }
            c if c.is_alphanumeric() || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let at = chars.get(i).copied();
                match (word.as_str(), at) {
                    ("r" | "br" | "cr", Some('"' | '#')) => {
                        let hashes = chars[i..].iter().take_while(|c| **c == '#').count();
                        if chars.get(i + hashes) == Some(&'"') {
                            i = skip_string(i + hashes + 1, Some(hashes), &mut line);
                        } else {
                            // `r#ident`: a raw identifier.
                            out.push((Token::Ident(word), line));
                        }
                    }
                    ("b" | "c", Some('"')) => i = skip_string(i + 1, None, &mut line),
                    ("b", Some('\'')) => i = skip_char(i).unwrap_or(i + 1),
                    _ => out.push((Token::Ident(word), line)),
                }
            }
            c => {
                out.push((Token::Punct(c), line));
                i += 1;
            }
        }
    }
    out
}

fn ident(t: Option<&(Token, usize)>) -> Option<&str> {
    match t {
        Some((Token::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn is(t: Option<&(Token, usize)>, want: &Token) -> bool {
    t.is_some_and(|(t, _)| t == want)
}

/// The first segment of each entry of the use group whose `{` is at `open`.
fn group_heads(toks: &[(Token, usize)], open: usize) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut at_entry_start = true;
    for (t, _) in &toks[open..] {
        match t {
            Token::Punct('{') => {
                depth += 1;
                at_entry_start = depth == 1;
            }
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            Token::Punct(',') if depth == 1 => at_entry_start = true,
            Token::Ident(s) if at_entry_start && depth == 1 => {
                heads.push(s.clone());
                at_entry_start = false;
            }
            _ if depth == 1 => at_entry_start = false,
            _ => {}
        }
    }
    heads
}

/// A path into the crate root found in a file: its first segment, where it is, and how
/// it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RootPath {
    head: String,
    line: usize,
    text: String,
}

/// The source text of the path starting at token `from`, as far as it goes.
fn path_text(toks: &[(Token, usize)], from: usize) -> String {
    let mut text = String::new();
    let mut depth = 0;
    for (t, _) in toks.iter().skip(from).take(40) {
        match t {
            Token::Ident(s) => text.push_str(s),
            Token::PathSep => text.push_str("::"),
            Token::Punct('{') => {
                depth += 1;
                text.push('{');
            }
            Token::Punct('}') if depth > 0 => {
                depth -= 1;
                text.push('}');
            }
            Token::Punct(',') if depth > 0 => text.push_str(", "),
            Token::Punct('*') => text.push('*'),
            _ if depth > 0 => {}
            _ => break,
        }
        if depth == 0 && text.ends_with('}') {
            break;
        }
    }
    text
}

/// Every path in `src` that reaches the crate root: `crate::…` (and `$crate::…`), or a
/// `super::…` that climbs out of `module` (the file's module path, e.g. `["link",
/// "forward"]` for `src/link/forward.rs`; inline `mod`s are added as they open).
fn root_paths(src: &str, module: &[String]) -> Vec<RootPath> {
    let toks = tokens(src);
    let mut found = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let (tok, line) = &toks[i];
        match tok {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Token::Ident(kw) if kw == "mod" => {
                if let (Some(name), true) = (
                    ident(toks.get(i + 1)),
                    is(toks.get(i + 2), &Token::Punct('{')),
                ) {
                    inline.push((name.to_owned(), depth));
                }
            }
            Token::Ident(kw) if kw == "crate" && is(toks.get(i + 1), &Token::PathSep) => {
                found.extend(heads_at(&toks, i + 2, *line, path_text(&toks, i)));
            }
            Token::Ident(kw)
                if kw == "super"
                    && is(toks.get(i + 1), &Token::PathSep)
                    && !(i >= 1 && is(toks.get(i - 1), &Token::PathSep)) =>
            {
                // `super::super::…`: how far it climbs.
                let mut up = 0;
                let mut j = i;
                while ident(toks.get(j)) == Some("super") && is(toks.get(j + 1), &Token::PathSep) {
                    up += 1;
                    j += 2;
                }
                let here = module.len() + inline.len();
                if up >= here {
                    // At (or, in broken code, past) the crate root.
                    found.extend(heads_at(&toks, j, *line, path_text(&toks, i)));
                }
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The first segments of the path (or use group) that starts at token `at`.
fn heads_at(toks: &[(Token, usize)], at: usize, line: usize, text: String) -> Vec<RootPath> {
    let heads = match toks.get(at) {
        Some((Token::Punct('{'), _)) => group_heads(toks, at),
        Some((Token::Ident(s), _)) => vec![s.clone()],
        Some((Token::Punct('*'), _)) => vec!["*".to_owned()],
        _ => Vec::new(),
    };
    heads
        .into_iter()
        .map(|head| RootPath {
            head,
            line,
            text: text.clone(),
        })
        .collect()
}

/// What `lib.rs` declares: its modules in order, and which module (or other crate) each
/// name its `use` items bring into the crate root comes from.
struct Root {
    modules: Vec<String>,
    reexports: BTreeMap<String, String>,
    /// Crates re-exported whole (`pub use actix;`): not modules of this crate.
    crates: Vec<String>,
    /// Items `lib.rs` defines itself (`pub type Result…`, `pub const VERSION…`): above
    /// every module.
    items: Vec<String>,
}

fn parse_root(lib: &str) -> Root {
    let toks = tokens(lib);
    let mut root = Root {
        modules: Vec::new(),
        reexports: BTreeMap::new(),
        crates: Vec::new(),
        items: Vec::new(),
    };
    let mut depth = 0;
    let mut i = 0;
    while i < toks.len() {
        match &toks[i].0 {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => depth -= 1,
            Token::Ident(kw) if kw == "mod" && depth == 0 => {
                if let (Some(name), true) = (
                    ident(toks.get(i + 1)),
                    is(toks.get(i + 2), &Token::Punct(';')),
                ) {
                    root.modules.push(name.to_owned());
                }
            }
            Token::Ident(kw)
                if depth == 0
                    && matches!(
                        kw.as_str(),
                        "const" | "static" | "type" | "fn" | "struct" | "enum" | "trait" | "union"
                    ) =>
            {
                if let Some(name) = ident(toks.get(i + 1)) {
                    root.items.push(name.to_owned());
                }
            }
            // `pub use` or `use`: either brings names into the crate root.
            Token::Ident(kw) if kw == "use" && depth == 0 => {
                // `use crate::m::…` and `use self::m::…` are `use m::…`.
                let mut head = i + 1;
                if matches!(ident(toks.get(head)), Some("crate" | "self"))
                    && is(toks.get(head + 1), &Token::PathSep)
                {
                    head += 2;
                }
                let Some(from) = ident(toks.get(head)) else {
                    i += 1;
                    continue;
                };
                let end = toks[i..]
                    .iter()
                    .position(|(t, _)| *t == Token::Punct(';'))
                    .map_or(toks.len(), |p| i + p);
                if end == head + 1 {
                    root.crates.push(from.to_owned());
                }
                // The names it brings in: each leaf of the tree, or its `as` name.
                for k in head + 1..end {
                    if let Some(name) = ident(toks.get(k)) {
                        let closes = matches!(
                            toks.get(k + 1).map(|t| &t.0),
                            Some(Token::Punct(',' | '}' | ';'))
                        );
                        let renamed = ident(toks.get(k + 1)) == Some("as");
                        if closes && name != "self" && !renamed {
                            root.reexports.insert(name.to_owned(), from.to_owned());
                        }
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    root
}

/// One use of a module declared below the user's.
struct Violation {
    file: String,
    line: usize,
    text: String,
    user: String,
    user_at: usize,
    used: String,
    used_at: usize,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: `{}`: module `{}` (#{} in lib.rs) uses `{}`, declared below it (#{})",
            self.file, self.line, self.text, self.user, self.user_at, self.used, self.used_at
        )
    }
}

/// A source file of a module.
struct SourceFile {
    /// Its path, as reported.
    name: String,
    /// Its module path (`["link", "forward"]` for `src/link/forward.rs`).
    module: Vec<String>,
    text: String,
}

/// Checks every module's files (`files`, by module) against the order of `root`: the
/// uses of modules declared below the user, and the paths that resolve to no module.
fn check(root: &Root, files: &BTreeMap<String, Vec<SourceFile>>) -> (Vec<Violation>, Vec<String>) {
    let position = |m: &str| root.modules.iter().position(|x| x == m);
    let mut violations = Vec::new();
    let mut unknown = Vec::new();
    for (at, user) in root.modules.iter().enumerate() {
        for SourceFile {
            name: file,
            module,
            text,
        } in files.get(user).into_iter().flatten()
        {
            for path in root_paths(text, module) {
                let used = match root.reexports.get(&path.head) {
                    Some(from) => from.clone(),
                    None => path.head.clone(),
                };
                let Some(used_at) = position(&used) else {
                    // Another crate, whole or an item of it, brought into the root; or an
                    // item of the root itself.
                    if !root.crates.contains(&path.head)
                        && !root.reexports.contains_key(&path.head)
                        && !root.items.contains(&path.head)
                    {
                        unknown.push(format!(
                            "{file}:{}: `{}`: `{}` is neither a module of lib.rs nor one of its re-exports",
                            path.line, path.text, path.head
                        ));
                    }
                    continue;
                };
                if used_at > at {
                    violations.push(Violation {
                        file: file.clone(),
                        line: path.line,
                        text: path.text,
                        user: user.clone(),
                        user_at: at + 1,
                        used,
                        used_at: used_at + 1,
                    });
                }
            }
        }
    }
    (violations, unknown)
}

/// `dir`'s `.rs` files, at any depth.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A known use of a module declared below its user, tolerated until the change that
/// removes it lands: `(user, used, why)`. An entry no use needs any more fails the test,
/// so that it is deleted with the cycle.
type Allowed = (&'static str, &'static str, &'static str);

/// The violations `allowed` does not cover, and the allowed uses no violation needs.
fn apply_allowed(violations: &[Violation], allowed: &[Allowed]) -> (Vec<String>, Vec<String>) {
    let covers = |(user, used, _): &Allowed, v: &Violation| v.user == *user && v.used == *used;
    let report = violations
        .iter()
        .filter(|v| !allowed.iter().any(|a| covers(a, v)))
        .map(ToString::to_string)
        .collect();
    let stale = allowed
        .iter()
        .filter(|a| !violations.iter().any(|v| covers(a, v)))
        .map(|(user, used, why)| format!("`{user}` -> `{used}` ({why})"))
        .collect();
    (report, stale)
}

/// The macros `text` exports at the crate root (`#[macro_export] macro_rules! name`): a
/// `crate::name!` anywhere is a use of the module that defines it.
fn exported_macros(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut exported = false;
    for line in text.lines().map(str::trim) {
        if line == "#[macro_export]" {
            exported = true;
        } else if let Some(rest) = line.strip_prefix("macro_rules!") {
            if exported {
                let name: String = rest
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.push(name);
            }
            exported = false;
        } else if !(line.starts_with("#[") || line.starts_with("///") || line.is_empty()) {
            exported = false;
        }
    }
    names
}

/// Checks that the modules of the workspace crate in `dir` form layers, but for `allowed`.
/// `min_modules`: how many modules its `lib.rs` declares at least (a guard against a
/// parser that finds none).
fn check_crate(dir: &str, min_modules: usize, allowed: &[Allowed]) {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crate_dir = workspace.join(dir);
    let src = crate_dir.join("src");
    let root = parse_root(&fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
    assert!(
        root.modules.len() >= min_modules,
        "{dir}/src/lib.rs should declare the crate's modules; found {:?}",
        root.modules
    );
    let mut files = BTreeMap::new();
    for module in &root.modules {
        let mut paths = vec![src.join(format!("{module}.rs"))];
        rust_files(&src.join(module), &mut paths);
        let mut sources = Vec::new();
        for path in paths {
            let source =
                fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let relative = path.strip_prefix(&src).expect("under src");
            let module_path: Vec<String> = relative
                .with_extension("")
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            let shown = path.strip_prefix(workspace).unwrap_or(&path);
            sources.push(SourceFile {
                name: shown.display().to_string(),
                module: module_path,
                text: source,
            });
        }
        files.insert(module.clone(), sources);
    }
    let mut root = root;
    for (module, sources) in &files {
        for source in sources {
            for name in exported_macros(&source.text) {
                root.reexports.insert(name, module.clone());
            }
        }
    }
    let (violations, unknown) = check(&root, &files);
    assert!(
        unknown.is_empty(),
        "unresolved paths:\n{}",
        unknown.join("\n")
    );
    let (report, stale) = apply_allowed(&violations, allowed);
    assert!(
        report.is_empty(),
        "a module may use only the modules declared above it in {dir}/src/lib.rs (the layers \
         in the crate docs); move what it needs down, or the user up:\n{}",
        report.join("\n")
    );
    assert!(
        stale.is_empty(),
        "allowed uses that no module makes any more: delete them from the allow-list:\n{}",
        stale.join("\n")
    );
}

#[test]
fn messages_modules_use_only_modules_declared_above_them() {
    check_crate("messages", 8, &[]);
}

#[test]
fn ipc_modules_use_only_modules_declared_above_them() {
    check_crate("ipc", 10, &[]);
}

#[test]
fn actors_modules_use_only_modules_declared_above_them() {
    check_crate("actors", 10, &[]);
}

fn heads(src: &str, module: &[&str]) -> Vec<String> {
    let module: Vec<String> = module.iter().map(|s| (*s).to_owned()).collect();
    root_paths(src, &module)
        .into_iter()
        .map(|p| p.head)
        .collect()
}

#[test]
fn every_form_of_path_to_the_crate_root_is_found() {
    let src = r##"
        use crate::alpha::A;
        use crate::{beta, gamma::{G, H}};
        pub(crate) fn f<'a>(x: &'a str) -> char {
            crate::delta::g();
            let _ = "crate::in_a_string";
            let _ = r#"crate::in_a_raw "string""#;
            let _ = b"crate::in_bytes";
            let q = '"';
            let _ = '\'';
            let _ = b'"';
            $crate::epsilon::m!();
            q
        } // crate::in_a_comment
        /* crate::in_a /* nested */ block comment */
        /// crate::in_a_doc_comment
        mod inner {
            use super::*;
            use super::super::zeta::Z;
            mod deeper {
                use super::super::super::eta::E;
            }
        }
        use super::theta;
        use crate::Reexported;
    "##;
    assert_eq!(
        heads(src, &["m"]),
        [
            "alpha",
            "beta",
            "gamma",
            "delta",
            "epsilon",
            "zeta",
            "eta",
            "theta",
            "Reexported"
        ]
    );
    // A file under `src/m/`: one `super::` stays in `m`, two reach the root.
    assert_eq!(
        heads(
            "use super::Here; use super::super::iota::I; super::sub::x();",
            &["m", "sub"]
        ),
        ["iota"]
    );
}

#[test]
fn a_module_that_uses_one_declared_below_it_is_named() {
    let root = parse_root(
        "//! docs: mod ignored;\nmod low;\npub mod high;\npub use high::{Api, Other as Renamed};\npub use ext_crate;\nuse std::fmt;\npub use crate::low::Low;\n",
    );
    assert_eq!(root.modules, ["low", "high"]);
    assert_eq!(root.reexports.get("Api").map(String::as_str), Some("high"));
    assert_eq!(
        root.reexports.get("Renamed").map(String::as_str),
        Some("high")
    );
    assert_eq!(root.reexports.get("Low").map(String::as_str), Some("low"));
    assert_eq!(root.reexports.get("fmt").map(String::as_str), Some("std"));
    assert_eq!(root.crates, ["ext_crate"]);
    let file = |name: &str, module: &[&str], text: &str| SourceFile {
        name: name.to_owned(),
        module: module.iter().map(|s| (*s).to_owned()).collect(),
        text: text.to_owned(),
    };
    let mut files = BTreeMap::new();
    files.insert(
        "low".to_owned(),
        vec![
            file(
                "src/low.rs",
                &["low"],
                "use crate::ext_crate::X; use crate::{Low, fmt::Debug}; fn f() { crate::Api::new(); }",
            ),
            file(
                "src/low/sub.rs",
                &["low", "sub"],
                "use super::super::high::H;",
            ),
        ],
    );
    files.insert(
        "high".to_owned(),
        vec![file(
            "src/high.rs",
            &["high"],
            "use crate::low::L; use crate::nowhere::N;",
        )],
    );
    let (violations, unknown) = check(&root, &files);
    let report: Vec<String> = violations.iter().map(ToString::to_string).collect();
    assert_eq!(
        report,
        [
            "src/low.rs:1: `crate::Api::new`: module `low` (#1 in lib.rs) uses `high`, declared below it (#2)",
            "src/low/sub.rs:1: `super::super::high::H`: module `low` (#1 in lib.rs) uses `high`, declared below it (#2)",
        ]
    );
    assert_eq!(unknown.len(), 1, "{unknown:?}");
    assert!(unknown[0].contains("`nowhere`"), "{unknown:?}");
}

#[test]
fn items_of_the_root_resolve_and_allowed_uses_must_still_be_needed() {
    let root = parse_root(
        "mod low;\nmod high;\npub type Result<T> = std::result::Result<T, ()>;\npub const VERSION: u8 = 2;\n",
    );
    assert_eq!(root.items, ["Result", "VERSION"]);
    let file = |name: &str, module: &str, text: &str| SourceFile {
        name: name.to_owned(),
        module: vec![module.to_owned()],
        text: text.to_owned(),
    };
    let mut files = BTreeMap::new();
    files.insert(
        "low".to_owned(),
        vec![file(
            "src/low.rs",
            "low",
            "use crate::{Result, VERSION}; use crate::high::H;",
        )],
    );
    files.insert("high".to_owned(), vec![file("src/high.rs", "high", "")]);
    let (violations, unknown) = check(&root, &files);
    assert!(unknown.is_empty(), "{unknown:?}");
    assert_eq!(violations.len(), 1);
    let (report, stale) = apply_allowed(&violations, &[("low", "high", "known")]);
    assert!(
        report.is_empty() && stale.is_empty(),
        "{report:?} {stale:?}"
    );
    let (report, stale) = apply_allowed(&violations, &[("high", "low", "gone")]);
    assert_eq!(report.len(), 1);
    assert_eq!(stale, ["`high` -> `low` (gone)"]);
}

#[test]
fn a_macro_exported_at_the_root_is_a_use_of_the_module_that_defines_it() {
    let low = "/// Docs.\n#[macro_export]\n#[doc(hidden)]\nmacro_rules! shout {\n    () => {};\n}\nmacro_rules! local { () => {}; }\n";
    assert_eq!(exported_macros(low), vec!["shout".to_owned()]);
    let mut root = parse_root("mod low;\nmod high;\n");
    for name in exported_macros(low) {
        root.reexports.insert(name, "low".to_owned());
    }
    let file = |module: &str, text: &str| SourceFile {
        name: format!("{module}.rs"),
        module: vec![module.to_owned()],
        text: text.to_owned(),
    };
    let files = BTreeMap::from([
        ("low".to_owned(), vec![file("low", "crate::shout!();\n")]),
        ("high".to_owned(), vec![file("high", "crate::shout!();\n")]),
    ]);
    let (violations, unknown) = check(&root, &files);
    assert!(unknown.is_empty(), "{unknown:?}");
    assert!(violations.is_empty(), "high uses low, declared above it");
    // Used from above the module that defines it: a violation, named as that module.
    let root = Root {
        modules: vec!["high".to_owned(), "low".to_owned()],
        ..root
    };
    let (violations, _) = check(&root, &files);
    assert_eq!(violations.len(), 1);
    assert_eq!(violations[0].used, "low");
}

// --- Files -------------------------------------------------------------------------------
//
// Within a module, its files must not use each other around a cycle either (issue 49):
// `src/cuda/backend.rs` may use `src/cuda/ordering.rs`, or the other way, not both. A file
// uses another when one of its `crate::…` or `super::…` paths leads into that file's module
// (the longest prefix of the path that is a file's module). Uses of a file's own ancestors
// (a child using its parent's items, as every `super::Parent` does) are the module tree,
// not a layer order, and do not count; nor do relative paths (`use copy::X` in `cuda.rs`),
// which only a parent writes to its children.

/// Every path of `src` that starts at the crate root or climbs with `super::`, as segments
/// from the crate root; `module` is the file's module path (inline `mod`s are added as they
/// open). A use group adds one path per entry's first segment.
fn absolute_paths(src: &str, module: &[String]) -> Vec<(Vec<String>, usize)> {
    let toks = tokens(src);
    let mut found = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    // The segments of the path from token `at` on (up to a group, expanded by its heads).
    let segments = |at: usize, base: Vec<String>| -> Vec<Vec<String>> {
        let mut path = base;
        let mut j = at;
        loop {
            match toks.get(j) {
                Some((Token::Ident(s), _)) => {
                    path.push(s.clone());
                    if is(toks.get(j + 1), &Token::PathSep) {
                        j += 2;
                        continue;
                    }
                    return vec![path];
                }
                Some((Token::Punct('{'), _)) => {
                    return group_heads(&toks, j)
                        .into_iter()
                        .map(|head| path.iter().cloned().chain([head]).collect())
                        .collect();
                }
                _ => return vec![path],
            }
        }
    };
    let mut i = 0;
    while i < toks.len() {
        let (tok, line) = &toks[i];
        match tok {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Token::Ident(kw) if kw == "mod" => {
                if let (Some(name), true) = (
                    ident(toks.get(i + 1)),
                    is(toks.get(i + 2), &Token::Punct('{')),
                ) {
                    inline.push((name.to_owned(), depth));
                }
            }
            Token::Ident(kw) if kw == "crate" && is(toks.get(i + 1), &Token::PathSep) => {
                let previous = i.checked_sub(1).and_then(|p| toks.get(p));
                if !is(previous, &Token::PathSep) {
                    for p in segments(i + 2, Vec::new()) {
                        found.push((p, *line));
                    }
                }
            }
            Token::Ident(kw)
                if kw == "super"
                    && is(toks.get(i + 1), &Token::PathSep)
                    && !(i >= 1 && is(toks.get(i - 1), &Token::PathSep)) =>
            {
                let mut up = 0;
                let mut j = i;
                while ident(toks.get(j)) == Some("super") && is(toks.get(j + 1), &Token::PathSep) {
                    up += 1;
                    j += 2;
                }
                // Where the code is: the file's module, then its open inline modules.
                let here: Vec<String> = module
                    .iter()
                    .cloned()
                    .chain(inline.iter().map(|(m, _)| m.clone()))
                    .collect();
                let base = here[..here.len().saturating_sub(up)].to_vec();
                for p in segments(j, base) {
                    found.push((p, *line));
                }
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The cycles among `files` (module path → source): each a list of file modules (`a/b`)
/// that use each other around a cycle, with one use of each edge as `user -> used (line)`.
fn file_cycles(files: &BTreeMap<Vec<String>, String>) -> Vec<Vec<String>> {
    let name = |m: &[String]| m.join("/");
    let mut uses: BTreeMap<Vec<String>, BTreeMap<Vec<String>, usize>> = BTreeMap::new();
    for (module, src) in files {
        let edges = uses.entry(module.clone()).or_default();
        for (path, line) in absolute_paths(src, module) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|k| path[..k].to_vec())
                .find(|prefix| files.contains_key(prefix))
            else {
                continue; // the crate root's own items
            };
            if target != *module && !module.starts_with(&target) {
                edges.entry(target).or_insert(line);
            }
        }
    }
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        uses: &'a BTreeMap<Vec<String>, BTreeMap<Vec<String>, usize>>,
        index: BTreeMap<Vec<String>, usize>,
        low: BTreeMap<Vec<String>, usize>,
        stack: Vec<Vec<String>>,
        cycles: Vec<Vec<Vec<String>>>,
    }
    fn visit(w: &mut Walk<'_>, v: &Vec<String>) {
        let n = w.index.len();
        w.index.insert(v.clone(), n);
        w.low.insert(v.clone(), n);
        w.stack.push(v.clone());
        let next: Vec<Vec<String>> = w
            .uses
            .get(v)
            .into_iter()
            .flat_map(|e| e.keys().cloned())
            .collect();
        for u in next {
            if !w.index.contains_key(&u) {
                visit(w, &u);
                let low = w.low[v].min(w.low[&u]);
                w.low.insert(v.clone(), low);
            } else if w.stack.contains(&u) {
                let low = w.low[v].min(w.index[&u]);
                w.low.insert(v.clone(), low);
            }
        }
        if w.low[v] == w.index[v] {
            let mut component = Vec::new();
            while let Some(u) = w.stack.pop() {
                let done = u == *v;
                component.push(u);
                if done {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                w.cycles.push(component);
            }
        }
    }
    let mut walk = Walk {
        uses: &uses,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        cycles: Vec::new(),
    };
    for v in files.keys() {
        if !walk.index.contains_key(v) {
            visit(&mut walk, v);
        }
    }
    walk.cycles
        .into_iter()
        .map(|component| {
            let mut shown = Vec::new();
            for user in &component {
                for (used, line) in &uses[user] {
                    if component.contains(used) {
                        shown.push(format!("{} -> {} (line {line})", name(user), name(used)));
                    }
                }
            }
            shown
        })
        .collect()
}

/// The `.rs` files under `dir` of the workspace, by module path from `dir` (`lib.rs`,
/// `main.rs` and `mod.rs` name their directory's module).
fn source_tree(dir: &str) -> BTreeMap<Vec<String>, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut paths = Vec::new();
    rust_files(&root, &mut paths);
    paths
        .into_iter()
        .map(|path| {
            let mut module: Vec<String> = path
                .strip_prefix(&root)
                .expect("under the directory")
                .with_extension("")
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if module
                .last()
                .is_some_and(|m| ["lib", "main", "mod"].contains(&m.as_str()))
            {
                module.pop();
            }
            let text =
                fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (module, text)
        })
        .collect()
}

fn assert_no_file_cycles(dir: &str, min_files: usize) {
    let files = source_tree(dir);
    assert!(
        files.len() >= min_files,
        "{dir}: expected at least {min_files} files, found {}",
        files.len()
    );
    let cycles = file_cycles(&files);
    assert!(
        cycles.is_empty(),
        "files of {dir} use each other around a cycle; move what both need into a file \
         below them:\n{}",
        cycles
            .iter()
            .map(|c| c.join("\n  "))
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

#[test]
fn no_two_files_of_a_crate_use_each_other_around_a_cycle() {
    assert_no_file_cycles("messages/src", 10);
    assert_no_file_cycles("ipc/src", 40);
    assert_no_file_cycles("actors/src", 30);
    assert_no_file_cycles("benches/handoff", 10);
}

#[test]
fn a_cycle_of_files_is_found_and_a_child_using_its_parent_is_none() {
    let tree = |files: &[(&str, &str)]| -> BTreeMap<Vec<String>, String> {
        files
            .iter()
            .map(|(m, src)| {
                let module = m
                    .split('/')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
                (module, (*src).to_owned())
            })
            .collect()
    };
    // `b` and `a/x` use each other (through `crate::` and `super::super::`); `a` uses `b`
    // (through a use group) but nothing leads back to it.
    let cycle = tree(&[
        ("", "mod a; mod b;"),
        ("a", "mod x; use crate::b::{Thing, other};"),
        ("b", "use crate::a::x::f;"),
        ("a/x", "fn f() { super::super::b::g(); }"),
    ]);
    assert_eq!(
        file_cycles(&cycle),
        vec![vec![
            "a/x -> b (line 1)".to_owned(),
            "b -> a/x (line 1)".to_owned()
        ]]
    );
    // Around three files, one of them reached through a use group.
    let three = tree(&[
        ("", "mod a; mod b; mod c;"),
        ("a", "use crate::{b::B, c::C};"),
        ("b", "use crate::c::C;"),
        ("c", "\n\nuse crate::a::A;"),
    ]);
    assert_eq!(
        file_cycles(&three),
        vec![vec![
            "a -> b (line 1)".to_owned(),
            "a -> c (line 1)".to_owned(),
            "b -> c (line 1)".to_owned(),
            "c -> a (line 3)".to_owned(),
        ]]
    );
    // A child using its parent (and the parent its child, relatively) is the module tree;
    // `super` inside an inline `mod tests` is the file itself; comments are not code.
    let tree_only = tree(&[
        ("", "mod a;"),
        ("a", "mod x; use x::Y; // crate::a::x"),
        (
            "a/x",
            "use super::Z; mod tests { use super::*; use crate::a::x::W; }",
        ),
    ]);
    assert_eq!(file_cycles(&tree_only), Vec::<Vec<String>>::new());
}

// --- The node tree -----------------------------------------------------------------------
//
// Every inherent `impl Node` of `baton-actors` is in one module tree, `actors/src/node.rs`
// and the files under `actors/src/node/` (issue 49), so that the node's whole API reads in
// one place. Where a method's work needs a module below the node, the method calls that
// module, which takes the node's state (`NodeCore`, in `node_core.rs`): the layers above
// keep every module from naming `Node` below the tree, and this check keeps `Node`'s
// methods from spreading back out.

/// The lines of `src`'s inherent `impl` blocks of the type `name` — `impl Name {`,
/// `impl Name<…>`, with or without generics on the `impl` and a path before the name — but
/// no trait impl (`impl Trait for Name`), and no other type whose name starts the same.
fn inherent_impls(src: &str, name: &str) -> Vec<usize> {
    let toks = tokens(src);
    // The index just past the `<…>` that opens at `at` (a `->` inside is no `>`).
    let past_generics = |at: usize| -> usize {
        let mut depth = 0;
        let mut j = at;
        while let Some((t, _)) = toks.get(j) {
            match t {
                Token::Punct('<') => depth += 1,
                Token::Punct('>') if !is(toks.get(j.wrapping_sub(1)), &Token::Punct('-')) => {
                    depth -= 1;
                    if depth == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        j
    };
    let mut found = Vec::new();
    for (i, (t, line)) in toks.iter().enumerate() {
        if !matches!(t, Token::Ident(kw) if kw == "impl") {
            continue;
        }
        let mut j = i + 1;
        if is(toks.get(j), &Token::Punct('<')) {
            j = past_generics(j);
        }
        // A path to the type (`crate::node::Node`).
        while ident(toks.get(j)).is_some() && is(toks.get(j + 1), &Token::PathSep) {
            j += 2;
        }
        if ident(toks.get(j)) != Some(name) {
            continue;
        }
        j += 1;
        if is(toks.get(j), &Token::Punct('<')) {
            j = past_generics(j);
        }
        // `{` or a `where` clause: inherent; `for`: an impl of a trait of that name.
        if is(toks.get(j), &Token::Punct('{')) || ident(toks.get(j)) == Some("where") {
            found.push(*line);
        }
    }
    found
}

#[test]
fn every_inherent_impl_of_node_is_in_the_node_tree() {
    let files = source_tree("actors/src");
    let mut in_tree = 0;
    let mut stray = Vec::new();
    for (module, src) in &files {
        for line in inherent_impls(src, "Node") {
            if module.first().map(String::as_str) == Some("node") {
                in_tree += 1;
            } else {
                let file = if module.is_empty() {
                    "lib".to_owned()
                } else {
                    module.join("/")
                };
                stray.push(format!("actors/src/{file}.rs:{line}"));
            }
        }
    }
    assert!(
        stray.is_empty(),
        "every inherent `impl Node` belongs in actors/src/node.rs or actors/src/node/ (see \
         node.rs's module docs); a lower module gives the method what it needs, taking a \
         `&NodeCore`:\n{}",
        stray.join("\n")
    );
    // A guard against a finder that finds none: node.rs and its five files have some.
    assert!(
        in_tree >= 6,
        "found {in_tree} `impl Node` blocks in the node tree"
    );
}

#[test]
fn inherent_impls_are_told_from_trait_impls_and_other_types() {
    let src = r#"
impl Node {}
impl fmt::Debug for Node {}
impl NodeCore {}
impl NodeConfig {}
impl<T> Node<T> where T: Clone {}
impl<F: Fn() -> u8> crate::node::Node {}
// impl Node {}
const S: &str = "impl Node {";
impl From<Node> for Peer {}
impl Node<u8> for X {}
impl Drop for Node {}
impl<T: Into<u8>> Node<Vec<T>> {}
"#;
    assert_eq!(inherent_impls(src, "Node"), [2, 6, 7, 13]);
}
