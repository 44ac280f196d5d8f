//! Group writes: many callers' rows written in one statement or transaction by a few
//! writer tasks sharing one queue. A writer takes everything waiting; only while another
//! writer's batch is still being written does it also wait a moment for more, since its own
//! write could not start sooner anyway. A lone caller is written at once, and under load
//! each write carries what arrived during the previous one: PostgreSQL's group commit,
//! done before the statement instead of at its flush.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, mpsc};

/// The writers of one queue: how many are writing a batch now.
#[derive(Debug, Default)]
pub struct Writers {
    writing: AtomicUsize,
}

/// One batch being written: counted in [`Writers`] until dropped.
pub struct Writing<'a>(&'a Writers);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.writing.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Writers {
    /// The next batch from `queue`: at least one item (waited for), at most `most`; `None`
    /// once every sender is gone and the queue is empty. Beyond what is waiting, items
    /// arriving within `gather` of the first are added while another batch is being
    /// written.
    pub async fn next_batch<T>(
        &self,
        queue: &Mutex<mpsc::Receiver<T>>,
        most: usize,
        gather: Duration,
    ) -> Option<Vec<T>> {
        let mut queue = queue.lock().await;
        let mut batch = waiting_in(&mut queue, most).await?;
        let gathered = tokio::time::sleep(gather);
        tokio::pin!(gathered);
        while batch.len() < most && self.writing.load(Ordering::Acquire) > 0 {
            tokio::select! {
                biased;
                item = queue.recv() => match item {
                    Some(item) => batch.push(item),
                    None => break,
                },
                _ = &mut gathered => break,
            }
        }
        Some(batch)
    }

    /// Counts a batch as being written until the guard is dropped.
    pub fn writing(&self) -> Writing<'_> {
        self.writing.fetch_add(1, Ordering::AcqRel);
        Writing(self)
    }
}

/// The next batch from `queue` without gathering: at least one item (waited for), then
/// whatever else waits, at most `most`; `None` once every sender is gone and the queue is
/// empty. For writers whose batches fill by themselves while they write.
pub async fn waiting<T>(queue: &Mutex<mpsc::Receiver<T>>, most: usize) -> Option<Vec<T>> {
    waiting_in(&mut *queue.lock().await, most).await
}

async fn waiting_in<T>(queue: &mut mpsc::Receiver<T>, most: usize) -> Option<Vec<T>> {
    let mut batch = vec![queue.recv().await?];
    while batch.len() < most {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    Some(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_batch_takes_what_waits_and_gathers_only_while_another_is_written() {
        let writers = Writers::default();
        let (tx, rx) = mpsc::channel(16);
        let rx = Mutex::new(rx);
        for i in 0..3 {
            tx.send(i).await.unwrap();
        }
        // Nothing being written: what waits, at once, however long the gathering window.
        let batch = writers.next_batch(&rx, 2, Duration::from_secs(3600)).await;
        assert_eq!(batch, Some(vec![0, 1]));
        let batch = writers.next_batch(&rx, 8, Duration::from_secs(3600)).await;
        assert_eq!(batch, Some(vec![2]));

        // Another batch being written: one sent after the first is taken along.
        let written = writers.writing();
        tx.send(3).await.unwrap();
        let late = tx.clone();
        let (batch, ()) = tokio::join!(
            writers.next_batch(&rx, 8, Duration::from_secs(3600)),
            async move {
                tokio::task::yield_now().await;
                late.send(4).await.unwrap();
                drop(written);
            }
        );
        assert_eq!(batch, Some(vec![3, 4]));

        drop(tx);
        assert_eq!(writers.next_batch(&rx, 8, Duration::ZERO).await, None);
    }

    #[tokio::test]
    async fn what_waits_is_taken_without_gathering() {
        let (tx, rx) = mpsc::channel(16);
        let rx = Mutex::new(rx);
        for i in 0..3 {
            tx.send(i).await.unwrap();
        }
        assert_eq!(waiting(&rx, 2).await, Some(vec![0, 1]));
        assert_eq!(waiting(&rx, 8).await, Some(vec![2]));
        let late = tx.clone();
        let (batch, ()) = tokio::join!(waiting(&rx, 8), async move {
            late.send(3).await.unwrap();
        });
        assert_eq!(batch, Some(vec![3]));
        drop(tx);
        assert_eq!(waiting(&rx, 8).await, None);
    }
}
