//! Names the commit the binaries are built from (`--version`, the `build_info` metric): the
//! `OUTBOX_COMMIT` variable when set (the image build passes it: the build context has no .git),
//! else `git rev-parse HEAD` of the checkout, else `unknown`. A `-dirty` suffix says the work tree
//! had changes. Never fails the build.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_COMMIT");
    let commit = std::env::var("OUTBOX_COMMIT")
        .ok()
        .map(|c| c.trim().chars().take(12).collect::<String>())
        .filter(|c| !c.is_empty())
        .or_else(|| {
            // Rebuild when HEAD moves (a commit, a checkout). Only files that exist are named: a
            // missing one would run this script at every build.
            if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
                let dir = std::path::Path::new(&dir);
                let mut watched = vec![dir.join("HEAD")];
                if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
                    watched.push(dir.join(head));
                }
                watched.push(dir.join("packed-refs"));
                for file in watched.iter().filter(|f| f.exists()) {
                    println!("cargo:rerun-if-changed={}", file.display());
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=OUTBOX_COMMIT={commit}");
}
