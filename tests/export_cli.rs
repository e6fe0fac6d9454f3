//! `mla-export` as a user runs it: bad values are refused by flag, nothing is overwritten
//! without `--force`, and files land in the current directory (or `--out`), never in the
//! source tree the binary was built from.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn export(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mla-export"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("mla-export runs")
}

fn temp(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("sparse-mla-export-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn bad_values_are_refused_by_flag_without_a_panic() {
    let dir = temp("bad");
    for (args, flag) in [
        (
            vec!["--heads", "16", "--topk", "4294967295", "--splits", "1"],
            "topk",
        ),
        (vec!["--heads", "16", "--topk", "2147483648"], "topk"),
        (
            vec!["--heads", "16", "--topk", "2048", "--splits", "4096"],
            "--splits",
        ),
        (vec!["--heads", "0", "--topk", "2048"], "--heads"),
        (
            vec!["--heads", "16", "--topk", "2048", "--tokens", "70000"],
            "--tokens",
        ),
    ] {
        let o = export(&dir, &args);
        let e = stderr(&o);
        assert!(matches!(o.status.code(), Some(1 | 2)), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{args:?}: {e}");
        assert!(e.contains(flag), "{args:?} should name {flag}: {e}");
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "a refused call wrote files"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn files_go_to_the_current_directory_and_are_not_overwritten_without_force() {
    let dir = temp("cwd");
    let args = ["--heads", "16", "--topk", "2048", "--lang", "cuda"];
    let o = export(&dir, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let written: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        written
            .iter()
            .any(|p| p.extension().is_some_and(|x| x == "cu")),
        "{written:?}"
    );
    // A hand-edited file is kept: the call fails, naming --force, and changes nothing.
    let header = written
        .iter()
        .find(|p| p.extension().is_some_and(|x| x == "h"))
        .expect("a launch header")
        .clone();
    std::fs::write(&header, "/* my edits */\n").unwrap();
    let o = export(&dir, &args);
    assert!(matches!(o.status.code(), Some(1 | 2)), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(&header).unwrap(),
        "/* my edits */\n"
    );
    // With --force it is replaced, and no temporary file is left behind.
    let o = export(&dir, &[&args[..], &["--force"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_ne!(
        std::fs::read_to_string(&header).unwrap(),
        "/* my edits */\n"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--all` into a folder that holds a kernel it wrote before under another name (a renamed
/// kernel) and a file of the user's: without `--force` the old kernel stays, named on
/// stderr; with it, it is removed and the user's file is kept; `--check` is then clean.
#[test]
fn a_renamed_kernel_is_removed_with_force_and_nothing_else() {
    let dir = temp("stale");
    let o = export(&dir, &["--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cuda = dir.join("cuda");
    let kept = std::fs::read_dir(&cuda)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "cu"))
        .expect("a kernel");
    let text = std::fs::read_to_string(&kept).unwrap();
    let old = cuda.join("sparse_mla_decode_split_old_name.cu");
    std::fs::write(&old, &text).unwrap();
    let mine = cuda.join("my_kernel.cu");
    std::fs::write(&mine, "// my own kernel\n").unwrap();
    let o = export(&dir, &["--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(old.exists() && stderr(&o).contains("sparse_mla_decode_split_old_name.cu"));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let o = export(&dir, &["--all", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!old.exists(), "the renamed kernel is removed");
    assert_eq!(
        std::fs::read_to_string(&mine).unwrap(),
        "// my own kernel\n"
    );
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), text);
    std::fs::remove_file(&mine).unwrap();
    let o = export(&dir, &["--check", "--out", "."]);
    assert!(o.status.success(), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
