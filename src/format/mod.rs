//! The format layer: what is inside a checkpoint file.
//!
//! - [`zipmap`]: maps a torch.save (zip) archive to record name -> data offset.
//! - [`zipwrite`]: writes a torch.save archive with an alignment per record, in one engine pass.
//! - [`integrity`]: the zip CRC-32 fields of files ckptio writes, and checking them.
//! - [`pickle`]: reads the pickles torch.save writes for state dicts (a safe subset).
//! - [`statedict`]: torch.save's pickle of a state dict, as torch's pickler writes it.
//! - [`safetensors`]: reads and checks safetensors headers.
//! - [`zstd`]: DCP items as zstd frames (torch's ZStandard stream transform).

pub mod integrity;
pub mod parts;
pub mod pickle;
pub mod safetensors;
pub mod statedict;
pub mod zipmap;
pub mod zipwrite;
pub mod zstd;
