//! The crate shows its design (issue 23): no module depends on itself through others (`use
//! crate::` and `super::` paths, read from the source with syn), no function is over 80 lines and
//! no file over 600. `lib.rs` declares and re-exports; it is not counted as a dependency.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::visit::Visit;

const MAX_FN_LINES: usize = 80;
const MAX_FILE_LINES: usize = 600;

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
fn no_function_over_80_lines_and_no_file_over_600() {
    struct Fns(Vec<(String, usize)>);
    impl<'ast> Visit<'ast> for Fns {
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            let span = f.span();
            self.0.push((f.sig.ident.to_string(), span.end().line - span.start().line + 1));
            syn::visit::visit_item_fn(self, f);
        }
        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            let span = f.span();
            self.0.push((f.sig.ident.to_string(), span.end().line - span.start().line + 1));
            syn::visit::visit_impl_item_fn(self, f);
        }
    }
    let mut long = Vec::new();
    for (module, path) in sources() {
        let text = std::fs::read_to_string(&path).expect("readable");
        if text.lines().count() > MAX_FILE_LINES {
            long.push(format!("{module}: {} lines", text.lines().count()));
        }
        let mut fns = Fns(Vec::new());
        fns.visit_file(&syn::parse_file(&text).expect("parses"));
        assert!(!fns.0.is_empty() || module == "testing", "{module}: no function found");
        long.extend(fns.0.into_iter().filter(|(_, n)| *n > MAX_FN_LINES).map(|(f, n)| format!("{module}::{f}: {n}")));
    }
    assert!(long.is_empty(), "{long:?}");
}
