//! Everything on real `redis-server` processes: the Redis store and its table of
//! cases, gateways sharing a Redis (or a cluster), the deny list shared through it,
//! store faults, `rediss://`, Redis Sentinel failovers, the fleet view, and degraded
//! mode (`on_error: local` splitting limits over the fleet in an outage). The tests
//! that matter most (exactness across instances, the scripts, the shared deny list,
//! `reserve`, the fleet) also run on Valkey's `valkey-server`: each written once
//! with `redis_and_valkey!`, run as `NAME::redis` and `NAME::valkey`.

#[path = "../common/mod.rs"]
mod common;

/// A test run twice: `NAME::redis` on `redis-server` and `NAME::valkey` on
/// `valkey-server` (`common::redis::Flavour`): `async fn` for a Tokio test, `fn`
/// for a plain one.
macro_rules! redis_and_valkey {
    ($(#[doc = $doc:expr])* async fn $name:ident() $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn body() $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                body().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn valkey() {
                let _valkey = crate::common::redis::Flavour::Valkey.enter();
                body().await
            }
        }
    };
    ($(#[doc = $doc:expr])* fn $name:ident() $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body() $body

            #[test]
            fn redis() {
                body()
            }

            #[test]
            fn valkey() {
                let _valkey = crate::common::redis::Flavour::Valkey.enter();
                body()
            }
        }
    };
}

mod abuse;
mod abusers;
mod degraded;
mod fleet;
mod redis_gateway;
mod redis_live_ops;
mod redis_store;
mod redis_tls;
mod reserve;
mod rls;
mod rls_envoy;
mod scripts_on_the_wire;
mod sentinel;
mod store_faults;
mod token_metered;
