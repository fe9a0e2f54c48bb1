//! Generates include/graphed.h from the Rust sources with cbindgen (settings
//! in cbindgen.toml) and adds the version macros from Cargo.toml. The header
//! is committed; the file is rewritten only when its content changes, and CI
//! fails when the committed copy is stale.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    // A SONAME, so that programs linked against this library record
    // "libgraphed.so" rather than the path it was linked from.
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgraphed.so");
    }

    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml is valid");
    let v = |k: &str| env::var(k).expect("cargo sets the package version");
    let macros = format!(
        "\n#define GRAPHED_VERSION_MAJOR {}\n#define GRAPHED_VERSION_MINOR {}\n#define GRAPHED_VERSION_PATCH {}\n#define GRAPHED_VERSION_STRING \"{}\"\n",
        v("CARGO_PKG_VERSION_MAJOR"),
        v("CARGO_PKG_VERSION_MINOR"),
        v("CARGO_PKG_VERSION_PATCH"),
        v("CARGO_PKG_VERSION"),
    );
    let bindings = cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .with_after_include(macros)
        .generate()
        .expect("cbindgen could not generate include/graphed.h");
    bindings.write_to_file(dir.join("include/graphed.h"));
}
