//! scripts/services refuses bad input with an error naming the problem and the fix, and leaves
//! nothing of its own running.

use std::path::{Path, PathBuf};
use std::process::Output;

use harness::env;
use harness::process::{ReservedPort, Spawn};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services")
}

/// A PATH holding every command of this machine except those whose name starts with `without`.
fn path_without(without: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(env::unique_name("path"));
    std::fs::create_dir_all(&dir).expect("temp bin dir");
    let system_path = std::env::var("PATH").unwrap_or_default();
    for bin in std::env::split_paths(&system_path) {
        let Ok(entries) = std::fs::read_dir(&bin) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let link = dir.join(&name);
            if name.to_string_lossy().starts_with(without) || link.exists() {
                continue;
            }
            let _ = std::os::unix::fs::symlink(entry.path(), link);
        }
    }
    dir
}

/// Runs `scripts/services <cmd>` with a private state dir and the given environment; the
/// emulators' ports are ports no service can take (a case that fails to refuse would fail to
/// start them, not clash with the suite's own).
fn services(state: &Path, cmd: &str, envs: &[(&str, String)]) -> Output {
    let ports = [(); 3].map(|()| ReservedPort::new());
    Spawn::program("bash")
        .arg(script())
        .arg(cmd)
        .env("OUTBOX_SERVICES_DIR", state)
        .env("DATABASE_URL", env::database_url())
        .env("PUBSUB_EMULATOR_PORT", ports[0].port().to_string())
        .env("BIGQUERY_EMULATOR_PORT", ports[1].port().to_string())
        .env("BIGQUERY_EMULATOR_GRPC_PORT", ports[2].port().to_string())
        .envs(envs)
        .output_blocking()
        .expect("run scripts/services")
}

fn state_dir() -> PathBuf {
    std::env::temp_dir().join(env::unique_name("services"))
}

#[test]
fn a_busy_port_is_refused_naming_the_port_and_the_variable_to_change() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let port = holder.local_addr().expect("addr").port();
    let state = state_dir();
    let out = services(&state, "up", &[("PUBSUB_EMULATOR_PORT", port.to_string())]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up fails on a busy port");
    assert!(
        stderr.contains(&format!("port {port}")),
        "names the port: {stderr}"
    );
    assert!(
        stderr.contains("PUBSUB_EMULATOR_PORT"),
        "says how to choose another: {stderr}"
    );
    services(&state, "down", &[]);
}

#[test]
fn an_unreachable_database_url_is_refused_with_the_password_masked() {
    let state = state_dir();
    let refused = ReservedPort::new();
    let url = format!("postgres://app:s3cret@127.0.0.1:{}/app", refused.port());
    let out = services(&state, "up", &[("DATABASE_URL", url)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "up fails when DATABASE_URL does not answer"
    );
    assert!(
        stderr.contains("DATABASE_URL is set but does not answer"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret"),
        "never prints the password: {stderr}"
    );
}

#[test]
fn a_missing_java_is_reported_with_how_to_install_it() {
    let state = state_dir();
    let bin = path_without("java");
    let out = services(&state, "up", &[("PATH", bin.display().to_string())]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up fails without Java");
    assert!(stderr.contains("Java 11+ is required"), "{stderr}");
    assert!(
        stderr.contains("apt-get install"),
        "says how to fix it: {stderr}"
    );
    services(&state, "down", &[]);
    let _ = std::fs::remove_dir_all(&bin);
}

#[test]
fn a_missing_python_is_reported_and_down_stops_what_up_started() {
    let state = state_dir();
    let bin = path_without("python");
    let envs = [
        ("PATH", bin.display().to_string()),
        ("OUTBOX_VENV_DIR", state.join("venv").display().to_string()),
    ];
    let out = services(&state, "up", &envs);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up fails without Python");
    assert!(stderr.contains("Python >= 3.11 is required"), "{stderr}");
    let down = services(&state, "down", &envs);
    assert!(
        down.status.success(),
        "down succeeds: {}",
        String::from_utf8_lossy(&down.stderr)
    );
    let status = services(&state, "status", &envs);
    let text = String::from_utf8_lossy(&status.stdout).to_string()
        + &String::from_utf8_lossy(&status.stderr);
    for service in ["pubsub", "bigquery"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(service))
            .unwrap_or_default();
        assert!(
            line.contains("stopped"),
            "{service} of ours is not left running: {text}"
        );
    }
    let _ = std::fs::remove_dir_all(&bin);
}
