//! The crate shows its design: no module depends on itself through others (`use crate::` and
//! `super::` paths, read from the source with syn). `lib.rs` declares and re-exports; it is not
//! counted as a dependency. A function's size is not capped here but its tangle is: clippy's
//! `cognitive_complexity` (make lint), which the last test checks is turned on.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// Every source file under rust/ but build.rs and lib.rs, by module path ("block", "python::watch").
fn sources() -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("rust/") {
            let path = entry.expect("an entry").path();
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            if path.is_dir() {
                walk(&path, &format!("{prefix}{stem}::"), out);
            } else if path.extension().is_some_and(|e| e == "rs") && !["lib", "build"].contains(&stem.as_str()) {
                let name =
                    if stem == "mod" { prefix.trim_end_matches("::").to_string() } else { format!("{prefix}{stem}") };
                out.insert(name, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("rust"), "", &mut out);
    out
}

/// The modules `module` names through `crate::` or `super::` paths (uses and expressions alike).
fn dependencies(module: &str, file: &syn::File, modules: &BTreeSet<String>) -> BTreeSet<String> {
    struct Paths(Vec<Vec<String>>);
    impl<'ast> Visit<'ast> for Paths {
        fn visit_path(&mut self, p: &'ast syn::Path) {
            self.0.push(p.segments.iter().map(|s| s.ident.to_string()).collect());
            syn::visit::visit_path(self, p);
        }
        fn visit_use_tree(&mut self, tree: &'ast syn::UseTree) {
            fn flatten(tree: &syn::UseTree, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
                match tree {
                    syn::UseTree::Path(p) => flatten(&p.tree, [prefix, vec![p.ident.to_string()]].concat(), out),
                    syn::UseTree::Group(g) => g.items.iter().for_each(|t| flatten(t, prefix.clone(), out)),
                    syn::UseTree::Name(n) => out.push([prefix, vec![n.ident.to_string()]].concat()),
                    syn::UseTree::Rename(r) => out.push([prefix, vec![r.ident.to_string()]].concat()),
                    syn::UseTree::Glob(_) => out.push(prefix),
                }
            }
            flatten(tree, Vec::new(), &mut self.0);
        }
    }
    let mut paths = Paths(Vec::new());
    paths.visit_file(file);
    let parent: Vec<&str> = module.rsplit_once("::").map_or(vec![], |(p, _)| p.split("::").collect());
    let mut out = BTreeSet::new();
    for path in paths.0 {
        let absolute: Vec<String> = match path.first().map(String::as_str) {
            Some("crate") => path[1..].to_vec(),
            Some("super") => parent.iter().map(|s| s.to_string()).chain(path[1..].iter().cloned()).collect(),
            _ => continue,
        };
        // the longest prefix that names a module of the crate
        let hit = (1..=absolute.len()).rev().map(|n| absolute[..n].join("::")).find(|m| modules.contains(m));
        if let Some(m) = hit.filter(|m| m != module && !module.starts_with(&format!("{m}::"))) {
            out.insert(m);
        }
    }
    out
}

fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn dfs(
        v: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == v) {
            return Some(path[i..].to_vec());
        }
        if !done.insert(v.to_string()) {
            return None;
        }
        path.push(v.to_string());
        for w in graph.get(v).into_iter().flatten() {
            if let Some(c) = dfs(w, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|v| dfs(v, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_depends_on_itself() {
    let sources = sources();
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    let graph: BTreeMap<String, BTreeSet<String>> = sources
        .iter()
        .map(|(m, p)| {
            let file = syn::parse_file(&std::fs::read_to_string(p).expect("readable")).expect("parses");
            (m.clone(), dependencies(m, &file, &modules))
        })
        .collect();
    assert!(graph["ownership"].contains("error") && graph["python::block"].contains("python::twins"), "{graph:?}");
    assert_eq!(cycle(&graph), None, "{graph:#?}");
    let planted: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "a")].into_iter().map(|(a, b)| (a.to_string(), BTreeSet::from([b.to_string()]))).collect();
    assert!(cycle(&planted).is_some(), "the cycle finder finds a planted cycle");
}

#[test]
fn functions_are_capped_by_clippys_cognitive_complexity() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("rust/lib.rs")).expect("readable");
    assert!(lib.contains("#![warn(clippy::cognitive_complexity)]"), "rust/lib.rs turns the lint on");
    let clippy = std::fs::read_to_string(root.join("clippy.toml")).expect("readable");
    let threshold = clippy
        .lines()
        .find_map(|l| l.strip_prefix("cognitive-complexity-threshold = "))
        .and_then(|n| n.trim().parse::<u32>().ok());
    assert!(threshold.is_some_and(|n| n <= 15), "clippy.toml caps it at 15 or less: {threshold:?}");
}
