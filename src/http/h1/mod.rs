//! HTTP/1.1: the server codec (`server`, with the request bodies it reads,
//! `request_body`) and the codec sluice speaks to upstreams (`upstream`), and what
//! they share: the head scanner (`head`), the framing rules (`framing`) and the body
//! decoder (`decode`).

pub mod decode;
pub mod framing;
pub(crate) mod head;
pub mod pooled;
pub mod request_body;
pub mod server;
pub mod upstream;
