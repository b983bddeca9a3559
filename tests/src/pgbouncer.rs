//! PgBouncer (Debian's package, `scripts/services up` installs it) in front of the test server,
//! for the tests that run the binaries through a connection pooler. Stopped when dropped.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::process::ReservedPort;

/// Debian's binary (in /usr/sbin, which a non-root PATH may lack).
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// A PgBouncer of its own, forwarding every database of the test server.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    port: ReservedPort,
    dir: PathBuf,
}

/// How PgBouncer hands out server connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// One server connection per client transaction.
    Transaction,
    /// One server connection per client connection.
    Session,
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` in front of the server of `DATABASE_URL` (trust auth as the
    /// server's own).
    pub async fn start(mode: PoolMode) -> Self {
        let admin: sqlx::postgres::PgConnectOptions = crate::env::database_url()
            .parse()
            .expect("DATABASE_URL parses");
        let port = ReservedPort::new();
        let dir = std::env::temp_dir().join(crate::env::unique_name("pgbouncer"));
        std::fs::create_dir_all(&dir).expect("create the PgBouncer folder");
        let user = admin.get_username().to_owned();
        // Transaction mode: few server connections, so that client transactions share them.
        // Session mode: one per client connection, for every client of a test.
        let (mode, servers) = match mode {
            PoolMode::Transaction => ("transaction", 4),
            PoolMode::Session => ("session", 40),
        };
        let config = format!(
            "[databases]\n* = host={host} port={server_port}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {listen_port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/userlist.txt\npool_mode = {mode}\n\
             max_client_conn = 500\ndefault_pool_size = {servers}\nmin_pool_size = 0\n\
             logfile = {dir}/pgbouncer.log\nadmin_users = {user}\n",
            host = admin.get_host(),
            server_port = admin.get_port(),
            dir = dir.display(),
            listen_port = port.port(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), config).expect("write pgbouncer.ini");
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))
            .expect("write userlist.txt");
        // PgBouncer refuses to run as root: as root, run it as the server's OS user.
        let mut cmd = if is_root() {
            let status = std::process::Command::new("chown")
                .args(["-R", "postgres:", &dir.display().to_string()])
                .status()
                .expect("run chown");
            assert!(status.success(), "chown the PgBouncer folder to postgres");
            let mut c = Command::new("setpriv");
            c.args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                PGBOUNCER,
            ]);
            c
        } else {
            Command::new(PGBOUNCER)
        };
        cmd.arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .expect("start pgbouncer (scripts/services up installs Debian's package)");
        let bouncer = Self { child, port, dir };
        crate::wait::wait_until(
            "PgBouncer accepts connections",
            Duration::from_secs(10),
            || {
                let addr = format!("127.0.0.1:{}", bouncer.port.port());
                async move {
                    tokio::net::TcpStream::connect(addr)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            },
        )
        .await;
        bouncer
    }

    /// `url` (a URL of the test server) through this PgBouncer.
    pub fn url_for(&self, url: &str) -> String {
        let admin: sqlx::postgres::PgConnectOptions = url.parse().expect("a postgres URL");
        let direct = format!("{}:{}", admin.get_host(), admin.get_port());
        assert!(url.contains(&direct), "{url} names {direct}");
        url.replacen(&direct, &format!("127.0.0.1:{}", self.port.port()), 1)
    }

    /// PgBouncer's log (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
