//! What a listener's server asks of the layer that answers its requests (`Site`:
//! the request path, or the admin API), and what it lends each request (`Lent`).

use std::future::Future;
use std::pin::Pin;

use http::StatusCode;

use crate::http::body::{Body, OnFail};
use crate::http::fields::AddedFields;
use crate::http::h1::upstream::RawFields;
use crate::http::request::ClientBody;
use crate::http::wake::Deadline;

/// Where a listener's requests go: the gateway's request path, or the
/// admin API.
pub(crate) trait Site: Send + Sync + 'static {
    /// The client's end of a connection, as the site wants it (made once per
    /// connection by the listener).
    type Peer: Send + Sync + 'static;

    /// What the end of a request does (`body::OnFail`, and its `Drop`): held by
    /// the server until the response body has ended or is dropped, as
    /// `body::guarded` holds it, but beside the body rather than boxed with it.
    type Guard: OnFail + Send + Sync + Unpin + 'static;

    /// The response to one request: its head, worked on in place, and its body;
    /// the request's guard, if it has one, in `guard`.
    fn serve<'a>(
        &'a self,
        parts: &'a mut http::request::Parts,
        body: ClientBody,
        peer: &'a Self::Peer,
        conn: Lent<'a>,
        guard: &'a mut Option<Self::Guard>,
    ) -> impl Future<Output = http::Response<Body>> + Send + 'a;

    /// The server answered `status` itself and closes: the head it refused
    /// starts `head` (as the client sent it, maybe cut or malformed). For the
    /// site's log; nothing by default.
    fn refused_head(&self, _status: StatusCode, _peer: &Self::Peer, _head: &[u8]) {}
}

/// What sluice's HTTP/1 server lends each of its requests.
pub(crate) struct Lent<'c> {
    /// Where the rate-limit fields the response gets go (`RateHeaders::fields`),
    /// for the server to write after the response's own fields, instead of going
    /// into its header map. (Only when the map has none of them: else they replace
    /// those where they stand.)
    pub fields: &'c mut AddedFields,
    /// What the upstream's response is read with (`Upstream::forward`).
    pub relay: Relay<'c>,
}

/// What sluice's HTTP/1 server lends a request for its upstream's response.
pub(crate) struct Relay<'c> {
    /// The connection's timer, for the upstream's response head.
    pub(crate) timer: Pin<&'c mut Deadline>,
    /// Where the upstream response's fields go when they can go to the client as
    /// they came (`RawFields`); None when the server cannot take them so.
    pub(crate) raw: Option<&'c mut Option<RawFields>>,
}

impl Relay<'_> {
    /// The upstream response's fields are wanted in its header map (a cost is read
    /// from one), not passed on as they came.
    pub(crate) fn fields_in_map(&mut self) {
        self.raw = None;
    }
}
