//! `info`: what this machine offers (libcuda, libcufile, huge pages, O_DIRECT
//! and cuFile handles for a folder).

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::gpu::{self, Backend};
use crate::io::file::{DirectMode, IoFile};
use crate::io::persist::AtomicFile;

/// What this machine offers: libcuda, libcufile, the pinned memory ckptio
/// holds and may hold, huge pages (and what fresh memory costs with and
/// without them), and (for `folder`) whether O_DIRECT and cuFile handles work
/// on files there, and why not.
#[pyfunction]
#[pyo3(signature = (folder=None))]
pub(super) fn info<'py>(py: Python<'py>, folder: Option<PathBuf>) -> PyResult<Bound<'py, PyDict>> {
    let (c, f, folder_info, h) = py.detach(|| {
        let c = crate::gpu::cuda::probe();
        let f = crate::gpu::cufile::probe();
        let fi = folder.map(|dir| probe_folder(&dir));
        (c, f, fi, crate::io::hugepage::probe())
    });
    let d = PyDict::new(py);
    let cd = PyDict::new(py);
    cd.set_item("found", c.found)?;
    cd.set_item("path", c.path)?;
    cd.set_item("driver_version", c.driver_version)?;
    cd.set_item("device_count", c.device_count)?;
    cd.set_item("reason", c.reason)?;
    d.set_item("cuda", cd)?;
    let fd = PyDict::new(py);
    fd.set_item("found", f.found)?;
    fd.set_item("path", f.path.clone())?;
    fd.set_item("version", f.version)?;
    fd.set_item("driver_open", f.driver_open)?;
    fd.set_item("nvfs_version", f.nvfs_version)?;
    fd.set_item("compat_mode", f.compat_mode)?;
    fd.set_item("run_udev", f.run_udev)?;
    fd.set_item("reason", f.reason.clone())?;
    d.set_item("cufile", fd)?;
    let hd = PyDict::new(py);
    hd.set_item("enabled", h.enabled)?;
    hd.set_item("shmem_enabled", h.shmem_enabled)?;
    hd.set_item("advice", h.advice)?;
    hd.set_item("free_page_reporting", h.free_page_reporting)?;
    hd.set_item("private_huge", h.private_huge)?;
    hd.set_item("shared_huge", h.shared_huge)?;
    hd.set_item("private_4k_gib_s", h.private_4k_gib_s)?;
    hd.set_item("private_huge_gib_s", h.private_huge_gib_s)?;
    hd.set_item("shared_gib_s", h.shared_gib_s)?;
    d.set_item("huge_pages", hd)?;
    let pd = PyDict::new(py);
    pd.set_item("held", crate::gpu::budget::held())?;
    pd.set_item("limit", crate::gpu::budget::limit().ok())?;
    d.set_item("pinned", pd)?;
    if let Some((path, direct, direct_reason, align, cufile, cufile_reason)) = folder_info {
        let x = PyDict::new(py);
        x.set_item("path", path)?;
        x.set_item("o_direct", direct)?;
        x.set_item("o_direct_reason", direct_reason)?;
        x.set_item("alignment", align)?;
        x.set_item("cufile_handle", cufile)?;
        x.set_item("cufile_reason", cufile_reason)?;
        d.set_item("folder", x)?;
    }
    Ok(d)
}

type FolderProbe = (
    PathBuf,
    bool,
    Option<String>,
    (usize, usize),
    bool,
    Option<String>,
);

fn probe_folder(dir: &std::path::Path) -> FolderProbe {
    let fail = |why: String| {
        (
            dir.to_path_buf(),
            false,
            Some(why.clone()),
            (0, 0),
            false,
            Some(why),
        )
    };
    let tmp = match AtomicFile::create_with(&dir.join(".ckptio-probe"), false) {
        Ok(t) => t,
        Err(e) => return fail(e.to_string()),
    };
    let file = match tmp.file().try_clone() {
        Ok(f) => f,
        Err(e) => return fail(e.to_string()),
    };
    let io = match IoFile::from_writable(file, tmp.tmp_path(), DirectMode::Auto) {
        Ok(io) => io,
        Err(e) => return fail(e.to_string()),
    };
    let a = io.alignment();
    // SAFETY: the handle is dropped at the end of this expression, before `io`.
    let (cufile, why) = match unsafe { gpu::open_device_path(&io, Backend::CuFile) } {
        Ok(p) => (
            true,
            p.gds_mode()
                .map(|m| format!("cuFile handle registered ({m} mode)")),
        ),
        Err(e) => (false, Some(e.to_string())),
    };
    let r = (
        dir.to_path_buf(),
        io.is_direct(),
        io.no_direct_reason().map(str::to_owned),
        (a.offset, a.memory),
        cufile,
        why,
    );
    drop(io);
    drop(tmp);
    r
}
