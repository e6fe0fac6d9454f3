//! The checked-in shaders/ and cuda/ are exactly what `mla-export --all` writes: generated
//! kernels are never edited by hand, and a description change must be re-exported.

use sparse_mla::export::{stale_files, standard_files};
use std::path::Path;

#[test]
fn checked_in_kernels_are_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = standard_files().expect("standard files");
    let stale = stale_files(root, &files);
    assert!(
        stale.is_empty(),
        "generated files are stale; run `cargo run --release --bin mla-export -- --all`:\n{}",
        stale.join("\n")
    );
}

#[test]
fn no_hand_written_kernels_anywhere() {
    // Every .wgsl / .cu file in the repository is one the standard set generates.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated: Vec<_> = standard_files()
        .expect("standard files")
        .into_iter()
        .map(|f| root.join(f.path))
        .collect();
    let mut stack = vec![root.to_path_buf()];
    let mut strays = Vec::new();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                // Hidden directories are tooling scratch (.git, .venv, carried GPU bundles).
                if !name.starts_with('.') && !matches!(name.as_str(), "target" | "examples") {
                    stack.push(p);
                }
            } else if (name.ends_with(".wgsl") || name.ends_with(".cu") || name.ends_with(".cuh"))
                && !generated.contains(&p)
            {
                strays.push(p.display().to_string());
            }
        }
    }
    assert!(strays.is_empty(), "hand-written kernel files: {strays:?}");
}
