//! The gRPC API of Sluice, `sluice.v1` (`sluice/v1/gateway.proto` beside this crate): the generated
//! tonic/prost types of `Gateway` and `CapabilityService`, the descriptor set for server reflection,
//! `convert` (JSON values ↔ `google.protobuf.Value`), and `client` (connecting with TLS and a token).
//!
//! Reading order: the .proto file → `convert` → `client`.

mod generated {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("sluice.v1");
}

pub mod client;
pub mod convert;

pub use generated::*;

/// Encoded descriptors for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sluice_descriptor");
