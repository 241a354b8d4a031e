//! The compile-fail suite: each case in tests/ui/cases.txt must fail with its stated rustc
//! error (snapshot in tests/ui/<case>.stderr), and its `<case>_fixed.rs` twin must compile and
//! run (tests/fixed_twins.rs, one binary for all twins). Update snapshots with
//! `TRYBUILD=overwrite cargo test --test compile_fail`.

fn cases() -> Vec<(&'static str, &'static str)> {
    include_str!("ui/cases.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut cols = l.split_whitespace();
            (cols.next().unwrap(), cols.next().unwrap())
        })
        .collect()
}

#[test]
fn ui() {
    every_snapshot_states_its_error_code();
    every_fixed_twin_asserts_instead_of_printing();
    every_fixed_twin_runs_in_fixed_twins_rs();
    let t = trybuild::TestCases::new();
    for (case, _) in cases() {
        t.compile_fail(format!("tests/ui/{case}.rs"));
    }
}

fn every_snapshot_states_its_error_code() {
    let cases = cases();
    assert_eq!(cases.len(), 7);
    for (case, code) in cases {
        let stderr = std::fs::read_to_string(format!("tests/ui/{case}.stderr"))
            .unwrap_or_else(|e| panic!("tests/ui/{case}.stderr: {e}"));
        let first = stderr.lines().find(|l| l.starts_with("error")).unwrap_or_default();
        assert_eq!(first.get(..12), Some(format!("error[{code}]").as_str()), "{case}: {first}");
    }
}

/// A `_fixed` twin proves its point with an assertion: what it printed would only be noise in
/// `make test`'s output (trybuild shows a passing binary's stdout).
fn every_fixed_twin_asserts_instead_of_printing() {
    for (case, _) in cases() {
        let path = format!("tests/ui/{case}_fixed.rs");
        let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!src.contains("print!") && !src.contains("println!"), "{path} prints");
        assert!(src.contains("assert"), "{path} asserts nothing");
    }
}

/// tests/fixed_twins.rs runs every case's twin, and only those.
fn every_fixed_twin_runs_in_fixed_twins_rs() {
    let runner = include_str!("fixed_twins.rs");
    let listed = runner.lines().filter(|l| l.starts_with("fixed_twin!(")).count();
    assert_eq!(listed, cases().len(), "tests/fixed_twins.rs lists {listed} twins");
    for (case, _) in cases() {
        let line = format!("fixed_twin!({case}, \"ui/{case}_fixed.rs\");");
        assert!(runner.contains(&line), "tests/fixed_twins.rs lacks `{line}`");
    }
}
