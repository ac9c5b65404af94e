//! Operating a running gateway: the control loop (reloads, deny list, bans), the
//! admin API with its dashboard, and the stats history.

pub mod admin;
pub mod control;
pub mod stats;
