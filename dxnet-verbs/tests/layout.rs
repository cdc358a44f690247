//! The `#[repr(C)]` declarations in `dxnet_verbs::ffi` must match
//! rdma-core's `<infiniband/verbs.h>` exactly.
//!
//! 1. Always (x86_64): against `layout_x86_64_rdma-core44.txt`, the output of
//!    `layout_probe.c` compiled against rdma-core 44 (Debian 12).
//! 2. Where a C compiler and `<infiniband/verbs.h>` (libibverbs-dev) exist:
//!    against the probe compiled right now against the installed header.
//!    Set `DXNET_VERBS_REQUIRE_HEADER=1` to make a missing header an error.

use std::path::PathBuf;
use std::process::Command;

fn compare(expected: &str, what: &str) {
    let ours = dxnet_verbs::ffi::layout_report();
    let exp: Vec<&str> = expected.lines().filter(|l| !l.trim().is_empty()).collect();
    let got: Vec<&str> = ours.lines().collect();
    let mut problems = Vec::new();
    for l in &exp {
        if !got.contains(l) {
            let key: String = l.rsplit_once(' ').map_or(*l, |(k, _)| k).to_string();
            let mine = got
                .iter()
                .find(|g| g.starts_with(&format!("{key} ")))
                .copied()
                .unwrap_or("<missing>");
            problems.push(format!("  {what}: {l:<50} ours: {mine}"));
        }
    }
    for g in &got {
        if !exp.contains(g) && !problems.iter().any(|p| p.ends_with(g)) {
            problems.push(format!("  ours only: {g}"));
        }
    }
    assert!(
        problems.is_empty(),
        "layout mismatch:\n{}",
        problems.join("\n")
    );
}

#[test]
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn layout_matches_rdma_core_44_reference() {
    compare(
        include_str!("layout_x86_64_rdma-core44.txt"),
        "rdma-core 44 reference",
    );
}

#[test]
fn layout_matches_installed_header() {
    let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
    let require = std::env::var_os("DXNET_VERBS_REQUIRE_HEADER").is_some_and(|v| v == "1");
    if !header.exists() {
        assert!(
            !require,
            "{} missing (apt-get install libibverbs-dev)",
            header.display()
        );
        eprintln!(
            "skipped: {} not installed (apt-get install libibverbs-dev)",
            header.display()
        );
        return;
    }
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/layout_probe.c");
    let out_dir = std::env::temp_dir().join(format!("dxnet-verbs-layout-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("layout_probe");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = match Command::new(&cc).arg("-o").arg(&exe).arg(&src).status() {
        Ok(s) => s,
        Err(e) => {
            assert!(!require, "cannot run the C compiler {cc}: {e}");
            eprintln!("skipped: cannot run the C compiler {cc}: {e}");
            return;
        }
    };
    assert!(status.success(), "compiling {} failed", src.display());
    let out = Command::new(&exe).output().expect("run layout probe");
    assert!(out.status.success());
    let _ = std::fs::remove_dir_all(&out_dir);
    compare(&String::from_utf8(out.stdout).unwrap(), "installed verbs.h");
}
