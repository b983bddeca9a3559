//! Async clean-up from `Drop`: a drop cannot await, and may run on a test's runtime (whose pooled
//! client connections a blocking wait would deadlock) or outside any runtime.

use std::future::Future;

/// Runs `work` to completion on a private current-thread runtime on a thread of its own, and
/// waits for it. Failures are ignored: clean-up is best effort (the service may be gone).
pub fn block_on_detached<F>(work: impl FnOnce() -> F + Send + 'static)
where
    F: Future<Output = ()>,
{
    let handle = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(work());
        }
    });
    let _ = handle.join();
}
