//! Shutdown as a value passed into the library: a [`Shutdown`] resolves when the process should
//! stop taking new work. [`on_signals`] wires it to SIGTERM/SIGINT, and a second signal fires
//! [`Signals::abort`]: `main` decides what that means (the binaries exit at once; work in flight
//! is abandoned, never lost: the database rolls back and the rows are reclaimed).

use tokio::sync::watch;

/// Fires a [`Shutdown`].
#[derive(Debug, Clone)]
pub struct Trigger(watch::Sender<bool>);

impl Trigger {
    /// Asks everything holding the matching [`Shutdown`] to stop.
    pub fn fire(&self) {
        let _ = self.0.send(true);
    }
}

/// Resolves when shutdown is requested. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Whether shutdown was requested.
    pub fn is_requested(&self) -> bool {
        *self.0.borrow()
    }

    /// Waits until shutdown is requested (at once if it already was).
    pub async fn requested(&mut self) {
        if self.0.wait_for(|stop| *stop).await.is_err() {
            // The trigger is gone, so nobody can ever ask: wait forever.
            std::future::pending::<()>().await;
        }
    }

    /// A shutdown that never fires (tests, one-shot runs).
    pub fn never() -> Self {
        channel().1
    }
}

/// A connected trigger and shutdown pair.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

/// The two stages of a signal-driven stop.
#[derive(Debug, Clone)]
pub struct Signals {
    /// Fires on the first SIGTERM or SIGINT: stop taking work, finish what is in flight.
    pub shutdown: Shutdown,
    /// Fires on the second: stop now.
    pub abort: Shutdown,
}

/// Listens for SIGTERM/SIGINT: the first fires [`Signals::shutdown`], the second
/// [`Signals::abort`].
pub fn on_signals() -> Signals {
    let (first, shutdown) = channel();
    let (second, abort) = channel();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!(
            "Shutdown requested: finishing the work in flight (send the signal again to stop at once)."
        );
        first.fire();
        wait_for_signal().await;
        second.fire();
    });
    Signals { shutdown, abort }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
