//! A Run's sandboxes go back to their pools once its answer is written, not before.
//!
//! Handing a sandbox back ends its cell and prepares the next one inside it (`end` and `init`): a
//! core for milliseconds, and in kube mode a relay through the API server, the kubelet and
//! containerd. Started before the answer left (as it was, when the run's task finished), all of it
//! competed with the answer's own path for the CPU: the gRPC encoding, TLS, and the client.
//!
//! The Run handler gives its response an [`Answered`] (in the response's extensions) and keeps the
//! run's [`Handback`] in a task that waits for it ([`hand_back_when_answered`]). [`after_answer`],
//! a response layer of the gRPC server, moves the `Answered` into the response body, which drops it
//! when the body yields its last frame (the trailers with the status) or is dropped: the task then
//! hands the sandboxes back. An answer the client does not take (a connection whose flow-control
//! window is full) holds them no longer than [`ANSWER_GRACE`]; without the layer (the service
//! called directly), the `Answered` goes with the response.

use hyper::body::{Body, Frame, SizeHint};
use sluice_engine::Handback;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;
use tonic::codegen::http;

/// The longest a run's sandboxes wait for its answer to be written.
pub(crate) const ANSWER_GRACE: Duration = Duration::from_millis(50);

/// Dropped when the answer it goes with has been written: a response extension (which must be
/// `Clone`), taken out once by [`after_answer`].
#[derive(Clone)]
pub(crate) struct Answered(Arc<Mutex<Option<oneshot::Sender<()>>>>);

impl Answered {
    fn take(&self) -> Option<oneshot::Sender<()>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Holds the run's sandboxes until the answer the returned [`Answered`] goes with is written (or
/// [`ANSWER_GRACE`] has passed), then hands them back.
pub(crate) fn hand_back_when_answered(handback: Handback) -> Answered {
    if handback.is_empty() {
        return Answered(Arc::new(Mutex::new(None)));
    }
    drop_when_answered(handback)
}

/// Drops `held` once the answer the returned [`Answered`] goes with is written, or after
/// [`ANSWER_GRACE`].
fn drop_when_answered<T: Send + 'static>(held: T) -> Answered {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        // Err (the sender dropped, the usual way) and Ok alike mean "written".
        let _ = tokio::time::timeout(ANSWER_GRACE, rx).await;
        drop(held);
    });
    Answered(Arc::new(Mutex::new(Some(tx))))
}

/// Holds `held` until `resp`'s body has been written (or [`ANSWER_GRACE`] has passed): the
/// proxies' way to keep sandboxes out of their pools while an answer leaves.
pub(crate) fn hold_until_written<T: Send + 'static>(
    resp: http::Response<crate::http_port::Body>,
    held: T,
) -> http::Response<crate::http_port::Body> {
    use http_body_util::BodyExt;
    let (parts, body) = resp.into_parts();
    let answered = drop_when_answered(held).take();
    http::Response::from_parts(parts, AfterAnswer { body, answered }.boxed())
}

/// The gRPC server's response layer: a response's [`Answered`] goes into its body.
pub(crate) fn after_answer<B>(resp: http::Response<B>) -> http::Response<AfterAnswer<B>> {
    let (mut parts, body) = resp.into_parts();
    let answered = parts.extensions.remove::<Answered>().and_then(|a| a.take());
    http::Response::from_parts(parts, AfterAnswer { body, answered })
}

/// A response body that drops its [`Answered`] sender with its last frame.
pub(crate) struct AfterAnswer<B> {
    body: B,
    answered: Option<oneshot::Sender<()>>,
}

impl<B: Body + Unpin> Body for AfterAnswer<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        let last = match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => true,
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers(),
            Poll::Pending => false,
        };
        if last {
            this.answered = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, StreamBody};
    use tonic::codegen::http::HeaderMap;

    /// Says when it is dropped.
    struct Probe(Option<oneshot::Sender<()>>);

    impl Drop for Probe {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }

    fn probe() -> (Probe, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (Probe(Some(tx)), rx)
    }

    type Frames =
        futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::convert::Infallible>>>;

    /// A unary gRPC answer as tonic writes it: one data frame, then the trailers with the status.
    fn answer(answered: Answered) -> http::Response<StreamBody<Frames>> {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let frames = vec![
            Ok(Frame::data(Bytes::from_static(b"answer"))),
            Ok(Frame::trailers(trailers)),
        ];
        let mut resp = http::Response::new(StreamBody::new(futures::stream::iter(frames)));
        resp.extensions_mut().insert(answered);
        resp
    }

    /// Whether the probe was dropped, after letting every other task run.
    async fn dropped(rx: &mut oneshot::Receiver<()>) -> bool {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        !matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty))
    }

    #[tokio::test]
    async fn what_a_run_held_goes_back_with_the_answers_last_frame_not_before() {
        let (held, mut gone) = probe();
        let mut body = after_answer(answer(drop_when_answered(held))).into_body();
        assert!(
            !dropped(&mut gone).await,
            "handed back before the answer was written"
        );
        let data = body.frame().await.expect("a frame").expect("no error");
        assert!(data.is_data());
        assert!(
            !dropped(&mut gone).await,
            "handed back before the answer's trailers"
        );
        let trailers = body.frame().await.expect("a frame").expect("no error");
        assert!(trailers.is_trailers());
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .expect("handed back once the trailers were written")
            .expect("the probe says so");
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_nobody_takes_holds_it_no_longer_than_the_grace() {
        let (held, mut gone) = probe();
        let body = after_answer(answer(drop_when_answered(held))).into_body();
        tokio::time::sleep(ANSWER_GRACE / 2).await;
        assert!(
            !dropped(&mut gone).await,
            "handed back before the grace was over"
        );
        tokio::time::sleep(ANSWER_GRACE).await;
        assert!(dropped(&mut gone).await, "still held after the grace");
        drop(body);
    }

    #[tokio::test]
    async fn a_response_dropped_unwritten_or_without_the_layer_hands_back() {
        let (held, gone) = probe();
        drop(after_answer(answer(drop_when_answered(held))));
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .expect("handed back with the dropped body")
            .expect("the probe says so");
        let (held, gone) = probe();
        drop(answer(drop_when_answered(held)));
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .expect("handed back with the dropped response")
            .expect("the probe says so");
    }
}
