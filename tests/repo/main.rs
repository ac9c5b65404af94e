//! What the repository ships besides `src/`, kept honest: the configurations the
//! docs show, the Docker fleet's files, the fuzz corpora, the PGO training
//! workload, the layers of `src/` (ARCHITECTURE.md); and the harness itself, which must leave no process behind.

#[path = "../common/mod.rs"]
mod common;

mod docs_examples;
mod fleet_files;
mod fuzz_corpus;
mod hygiene;
mod layers;
mod pgo_train;
