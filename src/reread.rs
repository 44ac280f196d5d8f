//! [`Reread`]: a value read from the database at most once a period, for what changes
//! slowly and is read often (learned estimates, observed latencies, the forecasts' record).

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::StoreError;

/// A value read at most every `every`; between reads, the last one.
pub struct Reread<T> {
    every: Duration,
    last: Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> Reread<T> {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: Mutex::new(None),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Option<(Instant, T)>> {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The value, read by `read` when there is none or it is older than the period.
    pub async fn get<F>(&self, read: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        if let Some((_, value)) = self.last().as_ref().filter(|(at, _)| at.elapsed() < self.every) {
            return Ok(value.clone());
        }
        let fresh = read.await?;
        *self.last() = Some((Instant::now(), fresh.clone()));
        Ok(fresh)
    }
}
