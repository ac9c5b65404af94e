//! Batching of script calls: while a call is out, the requests that arrive wait,
//! and the next call decides them all (up to `BATCH_MAX`). Under load, one call per
//! round trip instead of one per request, and Redis runs the script's setup once
//! for them all. A request that arrives while no call is out goes at once. (One
//! Redis server only: on a cluster each request's keys decide its node.)

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::oneshot;

use super::Error;

/// Requests sent in one script call at most: a call blocks Redis while it runs,
/// and 64 requests with one limit each take it about 0.5 ms.
const BATCH_MAX: usize = 64;

/// A call's reply: its integers, and the time the call decided at.
pub type Reply = Result<(Vec<i64>, u64), Error>;

/// One request's integers of a call's reply: its own call's, or its share of a call
/// the requests waiting together made (one reply for them all, not a copy each).
#[derive(Debug, Clone)]
pub enum Answer {
    Own(Vec<i64>),
    Shared(Arc<Vec<i64>>, std::ops::Range<usize>),
}

impl std::ops::Deref for Answer {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        match self {
            Answer::Own(v) => v,
            Answer::Shared(all, at) => &all[at.clone()],
        }
    }
}

/// What a request waiting in a batch is answered: its integers of the call's reply,
/// and the time the call decided at.
pub type Answered = Result<(Answer, u64), Error>;

/// Who sends a batch: one call for the parts in order, answering `reply_len`
/// integers for each, in order, then the time it decided at.
pub trait Sender: Send + Sync + 'static {
    type Part: Send + Sync + 'static;

    fn reply_len(part: &Self::Part) -> usize;

    fn send(&self, parts: &[&Self::Part]) -> impl Future<Output = Reply> + Send;
}

/// The requests waiting for a script call.
pub struct Batch<P> {
    queue: Mutex<Queue<P>>,
    wake: tokio::sync::Notify,
}

struct Queue<P> {
    waiting: Vec<Queued<P>>,
    /// The dispatcher found nothing to do and waits to be woken.
    idle: bool,
    closed: bool,
}

/// A request waiting for a script call, and where its reply goes.
struct Queued<P> {
    part: P,
    reply: oneshot::Sender<Answered>,
}

impl<P> Default for Batch<P> {
    fn default() -> Self {
        Batch {
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                idle: false,
                closed: false,
            }),
            wake: tokio::sync::Notify::new(),
        }
    }
}

impl<P> Batch<P> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<P>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `part`; its reply comes on the receiver (closed if the batch is).
    pub fn push(&self, part: P) -> oneshot::Receiver<Answered> {
        let (reply, rx) = oneshot::channel();
        let wake = {
            let mut queue = self.lock();
            queue.waiting.push(Queued { part, reply });
            std::mem::take(&mut queue.idle)
        };
        if wake {
            self.wake.notify_one();
        }
        rx
    }

    /// The sender is gone: waiting requests get an error, the dispatcher ends.
    pub fn close(&self) {
        let waiting = {
            let mut queue = self.lock();
            queue.closed = true;
            std::mem::take(&mut queue.waiting)
        };
        drop(waiting);
        self.wake.notify_one();
    }
}

/// Sends the waiting requests, one call at a time, and hands each its part of the
/// reply. Requests that stopped waiting (timed out, or their client left) before
/// their call was sent are left out of it. Ends when the sender is dropped.
pub async fn dispatch<S: Sender>(sender: Weak<S>, batch: Arc<Batch<S::Part>>) {
    let mut sending: Vec<Queued<S::Part>> = Vec::with_capacity(BATCH_MAX);
    loop {
        let idle = {
            let mut queue = batch.lock();
            if queue.closed {
                return;
            }
            let n = queue.waiting.len().min(BATCH_MAX);
            sending.extend(queue.waiting.drain(..n));
            queue.idle = n == 0;
            queue.idle
        };
        if idle {
            batch.wake.notified().await;
            continue;
        }
        sending.retain(|q| !q.reply.is_closed());
        if sending.is_empty() {
            continue;
        }
        let Some(s) = sender.upgrade() else {
            return;
        };
        let parts: Vec<&S::Part> = sending.iter().map(|q| &q.part).collect();
        let result = s.send(&parts).await;
        drop(parts);
        drop(s);
        match result {
            Ok((reply, now)) => {
                let reply = Arc::new(reply);
                let mut at = 0;
                for q in sending.drain(..) {
                    let n = S::reply_len(&q.part);
                    let share = Answer::Shared(reply.clone(), at..at + n);
                    let _ = q.reply.send(Ok((share, now)));
                    at += n;
                }
            }
            Err(e) => {
                for q in sending.drain(..) {
                    let _ = q.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
