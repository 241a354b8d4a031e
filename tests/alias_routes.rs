//! Every alias route the crate knows (`plusequals::aliases`), and what each one does.
//!
//! Refused routes: `forward_owned` (or `add_in_place`) returns `Error::NotOwned` naming the
//! argument and the reason, and the other name's bytes (or the gradient that depends on them)
//! are bitwise unchanged. The two tch-API routes are the documented exceptions: the write goes
//! through, because that is tch's API in user code, which this crate cannot refuse.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use plusequals::aliases::{routes, Outcome};
use plusequals::ownership::{Alias, Holders};
use plusequals::Error;

/// The argument a refusal must name, and the reasons it may give.
type Refusal = (&'static str, fn(&Alias) -> bool);

fn expected(route: &str) -> Option<Refusal> {
    Some(match route {
        "shallow_clone" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Rust)),
        // detach() shares the storage with a TensorImpl of its own; a view also holds its base.
        "detach" => ("x", |a| *a == Alias::SharedStorage(1)),
        "view / reshape" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Views)),
        "narrow / indexing" | "transpose / expand" => ("x", |a| *a == Alias::OtherHandles(2, Holders::Views)),
        "context overlaps x" => ("context", |a| *a == Alias::OverlapsX),
        "grad mode back on" => ("x", |a| *a == Alias::GradMode),
        "autograd saved x" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Rust)),
        "add_in_place while autograd holds x" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Rust)),
        "foreign memory" => ("x", |a| *a == Alias::ForeignMemory),
        // No use count shows a weak reference: libtorch's weak count does.
        "weak reference kept" => ("x", |a| *a == Alias::WeakRefs(1)),
        "C++ twin: shallow_clone kept" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Rust)),
        "in-place op's returned handle" => ("x", |a| *a == Alias::OtherHandles(1, Holders::Rust)),
        _ => return None,
    })
}

#[test]
fn every_route_is_refused_before_any_write_or_is_a_documented_tch_exception() -> plusequals::Result<()> {
    let routes = routes();
    assert_eq!(routes.len(), 15);
    for route in routes {
        let outcome = (route.run)()?;
        match (expected(route.name), outcome) {
            (Some((arg, why)), Outcome::Refused { error: Error::NotOwned { arg: got, why: reason }, unchanged }) => {
                assert_eq!(got, arg, "{}: refused the wrong argument ({reason})", route.name);
                assert!(why(&reason), "{}: refused for {reason:?}", route.name);
                assert!(unchanged, "{}: refused, but the other name changed", route.name);
            }
            (None, Outcome::Written) => assert!(route.name.starts_with("tch API"), "{}", route.name),
            (_, other) => panic!("{}: {other:?}", route.name),
        }
    }
    Ok(())
}

#[test]
fn a_refusal_names_the_argument_and_the_reason() -> plusequals::Result<()> {
    let route = routes().into_iter().find(|r| r.name == "detach").unwrap();
    let Outcome::Refused { error, .. } = (route.run)()? else { panic!("detach was not refused") };
    let message = error.to_string();
    assert!(message.starts_with("x refused for an in-place write: it shares its storage"), "{message}");
    assert!(message.contains("with 1 other tensor(s)"), "{message}");
    Ok(())
}
