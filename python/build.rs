//! The extension looks for NVRTC in `sparse_mla/_nvrtc/` too (a RUNPATH of `$ORIGIN/_nvrtc`),
//! where the Python package links a `libnvrtc.so` found elsewhere (a CUDA 13 wheel's
//! `libnvrtc.so.13`, which the loader would not find under the names it tries).
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/_nvrtc");
    }
}
