//! The compile-fail suite's other half: each case's `tests/ui/<case>_fixed.rs` twin compiles and
//! runs (its assertions hold). Every twin is a module of this one test binary, where trybuild would
//! build and link one binary per twin against libtorch; the demo still builds each as its own
//! binary (`python -m plusequals demo`). tests/compile_fail.rs checks that every case is here.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

macro_rules! fixed_twin {
    ($case:ident, $path:literal) => {
        #[path = $path]
        mod $case;

        #[test]
        fn $case() -> plusequals::Result<()> {
            $case::main()
        }
    };
}

fixed_twin!(mutate_borrowed_input, "ui/mutate_borrowed_input_fixed.rs");
fixed_twin!(use_after_move, "ui/use_after_move_fixed.rs");
fixed_twin!(borrow_across_move, "ui/borrow_across_move_fixed.rs");
fixed_twin!(two_mutable_paths, "ui/two_mutable_paths_fixed.rs");
fixed_twin!(borrow_across_inplace_add, "ui/borrow_across_inplace_add_fixed.rs");
fixed_twin!(inplace_needs_no_grad, "ui/inplace_needs_no_grad_fixed.rs");
fixed_twin!(grad_back_on_while_proof_held, "ui/grad_back_on_while_proof_held_fixed.rs");
