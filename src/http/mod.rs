//! Everything HTTP knows on the wire: the body type of every answer, the framing
//! rules, the HTTP/1 codecs (server, and to upstreams; HTTP/2 is hyper's), and the
//! transport to upstreams both HTTP versions share.

pub mod body;
pub mod conn;
pub mod fields;
pub mod h1;
pub mod request;
pub(crate) mod site;
pub mod transport;
pub(crate) mod wake;
