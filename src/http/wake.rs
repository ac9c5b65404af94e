//! `OnWake`: a future polled again only after it asked to be; `Deadline`: one
//! timer for a connection's successive deadlines.
//!
//! A connection's loop waits on its socket and, beside it, on futures that almost
//! never finish: its header timer, its idle timer, the server's stop signal. A
//! `select!` polls all of them every time the task wakes, once per request or more,
//! and each of those polls re-registers what is already registered (a timer entry,
//! a `Notify` waiter under its lock). Wrapped in `OnWake`, such a future gets a
//! waker of its own and is polled only after that waker was woken: every other
//! poll is an atomic load and a waker comparison.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio::time::{Instant, Sleep};

pin_project_lite::pin_project! {
    pub(crate) struct OnWake<F> {
        #[pin]
        fut: F,
        signal: Arc<Signal>,
        // `signal` as a waker, made once.
        waker: Waker,
        // The inner future is pending and has the signal's waker: it is polled
        // again only once the signal is woken.
        armed: bool,
    }
}

struct Signal {
    woken: AtomicBool,
    /// The task that polls the `OnWake`.
    task: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> OnWake<F> {
    pub(crate) fn new(fut: F) -> OnWake<F> {
        let signal = Arc::new(Signal {
            woken: AtomicBool::new(false),
            task: AtomicWaker::new(),
        });
        OnWake {
            fut,
            waker: Waker::from(signal.clone()),
            signal,
            armed: false,
        }
    }

    /// The inner future, to look at.
    pub(crate) fn get(&self) -> &F {
        &self.fut
    }

    /// The inner future, to change it (a timer's deadline): it is polled on the next
    /// poll, woken or not.
    pub(crate) fn inner(self: Pin<&mut Self>) -> Pin<&mut F> {
        let this = self.project();
        *this.armed = false;
        this.fut
    }
}

impl<F: Future> Future for OnWake<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        // First, so that a wake from now on reaches this task.
        this.signal.task.register(cx.waker());
        let woken = this.signal.woken.swap(false, Ordering::Acquire);
        if *this.armed && !woken {
            return Poll::Pending;
        }
        let polled = this.fut.poll(&mut Context::from_waker(this.waker));
        *this.armed = polled.is_pending();
        polled
    }
}

pin_project_lite::pin_project! {
    /// A connection's deadlines, one after the other (the next request head's, the
    /// upstream answer's), on one timer. Setting a deadline is a store: the timer is
    /// moved only when it would fire after the new deadline. When it fires before the
    /// deadline it is moved on to it then, about once per timeout period instead of
    /// once per request (a timer entry made, registered and removed for every
    /// request cost about 600 instructions).
    pub(crate) struct Deadline {
        #[pin]
        timer: OnWake<Sleep>,
        at: Instant,
    }
}

impl Deadline {
    pub(crate) fn new(at: Instant) -> Deadline {
        Deadline {
            timer: OnWake::new(tokio::time::sleep_until(at)),
            at,
        }
    }

    pub(crate) fn set(self: Pin<&mut Self>, at: Instant) {
        let this = self.project();
        *this.at = at;
        if this.timer.get().deadline() > at {
            this.timer.inner().reset(at);
        }
    }

    /// Ready once the deadline has passed.
    pub(crate) fn poll_passed(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut this = self.project();
        loop {
            std::task::ready!(this.timer.as_mut().poll(cx));
            if Instant::now() >= *this.at {
                return Poll::Ready(());
            }
            this.timer.as_mut().inner().reset(*this.at);
        }
    }

    /// Resolves once the deadline has passed.
    pub(crate) async fn passed(mut self: Pin<&mut Self>) {
        std::future::poll_fn(|cx| self.as_mut().poll_passed(cx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts its polls; ready once `ready` is set, waking whoever it was given when
    /// `wake` is called.
    struct Probe {
        polls: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
        waker: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for Probe {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.ready.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    struct Task(AtomicUsize);
    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn polled_again_only_after_its_waker_was_woken() {
        let polls = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(false));
        let inner_waker = Arc::new(std::sync::Mutex::new(None::<Waker>));
        let mut f = Box::pin(OnWake::new(Probe {
            polls: polls.clone(),
            ready: ready.clone(),
            waker: inner_waker.clone(),
        }));
        let task = Arc::new(Task(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);

        assert!(f.as_mut().poll(&mut cx).is_pending());
        assert!(f.as_mut().poll(&mut cx).is_pending());
        assert!(f.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "not woken: not polled again"
        );

        ready.store(true, Ordering::SeqCst);
        inner_waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert!(f.as_mut().poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn changing_the_inner_future_polls_it_on_the_next_poll() {
        let polls = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(false));
        let mut f = Box::pin(OnWake::new(Probe {
            polls: polls.clone(),
            ready: ready.clone(),
            waker: Arc::new(std::sync::Mutex::new(None)),
        }));
        let task = Arc::new(Task(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);

        assert!(f.as_mut().poll(&mut cx).is_pending());
        ready.store(true, Ordering::SeqCst);
        let _inner: Pin<&mut Probe> = f.as_mut().inner();
        assert!(f.as_mut().poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
        assert_eq!(task.0.load(Ordering::SeqCst), 0);
    }
}
