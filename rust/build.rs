//! Link flags the torch-sys build script does not emit itself.
//!
//! * `-rpath <libtorch lib dir>`: test binaries and the extension find libtorch without
//!   LD_LIBRARY_PATH (the lib dir is the pip torch's `torch/lib`); before it
//!   `$ORIGIN/../torch/lib`, the torch installed beside the extension (a wheel in another venv).
//! * `--no-as-needed -ltorch`: keeps `libtorch.so` (which pulls in `libtorch_cuda.so`) as a
//!   dependency even though no Rust symbol references it directly. Without it the CUDA kernels
//!   are never registered when Rust calls libtorch, and CUDA ops fail with "Could not run ...
//!   with arguments from the 'CUDA' backend" (tch-rs issues #923, #177, #1015).
//!
//! It also compiles `cpp/` (the `cc` crate) against the pip torch's own headers, the ones
//! torch-sys compiles against: `tensor_facts.cpp`, the libtorch bookkeeping that
//! `rust/ownership.rs` reads; `block.cpp`, the C++ twin, and its C ABI `capi.cpp`
//! (`rust/cpp.rs`); `gallery.cpp`, the seed's bugs written in C++, all of which compile; and
//! `weak_ref.cpp`, a storage weak reference for the alias routes (`rust/aliases.rs`).
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=rust/build.rs");
    println!("cargo:rerun-if-changed=cpp");
    let lib_dir = std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys sets DEP_TCH_LIBTORCH_LIB");
    // First the torch beside an installed extension (site-packages/plusequals/../torch/lib): a
    // wheel, or a `pip install` whose build environment (and its torch) is gone afterwards.
    println!("cargo:rustc-link-arg=-Wl,-rpath=$ORIGIN/../torch/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath={lib_dir}");
    // pip torch: torch/lib holds the libraries, torch/include the headers.
    let include = Path::new(&lib_dir).join("../include");
    cc::Build::new()
        .cpp(true)
        .file("cpp/tensor_facts.cpp")
        .file("cpp/block.cpp")
        .file("cpp/capi.cpp")
        .file("cpp/gallery.cpp")
        .file("cpp/weak_ref.cpp")
        .opt_level(2) // the twin is timed; the C++ of a debug build is optimised too
        .debug(false) // one object file for every profile (compiled once: .cargo/config.toml)
        .include(&include)
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .compile("plusequals_cpp");
    // The compiler's version, for the benchmark report's environment (the GPU machine has none).
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    println!("cargo:rustc-env=PLUSEQUALS_RUSTC_VERSION={}", version.trim());
    // tch's version, written once: Cargo.toml's exact pin, which torch-sys and pyo3-tch must repeat
    // (they are built together); the extension exposes it as `_rust.TCH_VERSION`, which the demo
    // and the report use and tests/test_install_config.py checks the comments and the guide against.
    println!("cargo:rerun-if-changed=Cargo.toml");
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let manifest = std::fs::read_to_string(Path::new(&manifest_dir).join("Cargo.toml")).expect("Cargo.toml");
    let tch = pin(&manifest, "tch");
    for other in ["torch-sys", "pyo3-tch"] {
        assert_eq!(pin(&manifest, other), tch, "Cargo.toml: {other} must be pinned to tch's version");
    }
    println!("cargo:rustc-env=PLUSEQUALS_TCH_VERSION={tch}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}

/// The exact version Cargo.toml pins `name` to: `name = "=X"` or `name = { version = "=X", ... }`.
fn pin(manifest: &str, name: &str) -> String {
    let prefix = format!("{name} = ");
    let line = manifest.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("Cargo.toml has no {name}"));
    let start = line.find("\"=").unwrap_or_else(|| panic!("Cargo.toml: {name} is not pinned with =")) + 2;
    let len = line[start..].find('"').expect("a closing quote");
    line[start..start + len].to_string()
}
