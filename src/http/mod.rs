//! Everything HTTP knows on the wire: the body type of every answer, the framing
//! rules, and the HTTP/1 server and client codecs (HTTP/2 is hyper's).

pub mod body;
pub mod conn;
pub mod fields;
pub mod h1;
pub(crate) mod wake;
