//! The format layer: what is inside a checkpoint file.
//!
//! - [`zipmap`]: maps a torch.save (zip) archive to record name -> data offset.
//! - [`integrity`]: the zip CRC-32 fields of files ckptio writes, and checking them.
//! - [`zstd`]: DCP items as zstd frames (torch's ZStandard stream transform).

pub mod integrity;
pub mod zipmap;
pub mod zstd;
