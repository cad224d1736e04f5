//! Generated gRPC types of `sluice.v1` (gateway/proto).

#![allow(clippy::all, missing_docs)]
tonic::include_proto!("sluice.v1");

/// Encoded descriptors for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sluice_descriptor");
