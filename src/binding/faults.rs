//! Test-only fault injection, as Python sees it.

use pyo3::prelude::*;

use crate::io::fault;

/// Test only (needs CKPTIO_TEST_FAULTS=1 at process start): make the `nth`
/// next hit of a fault point fail with `errno`. Points: create, fallocate,
/// write, read, crc, fsync, rename, fsync_dir.
#[pyfunction]
#[pyo3(signature = (point, errno, nth=1))]
pub(super) fn _set_fault(point: &str, errno: i32, nth: u64) -> PyResult<()> {
    fault::set_fault(point.parse()?, errno, nth)?;
    Ok(())
}

/// Test only (CKPTIO_TEST_FAULTS=1): at the `nth` next hit of a fault point,
/// truncate the file being transferred to `length` bytes, then go on (a file
/// that shrinks while it is read).
#[pyfunction]
#[pyo3(signature = (point, length, nth=1))]
pub(super) fn _set_truncation(point: &str, length: u64, nth: u64) -> PyResult<()> {
    fault::set_truncation(point.parse()?, length, nth)?;
    Ok(())
}

/// Test only: drop pending faults and stop recording; returns the points of
/// faults that never fired.
#[pyfunction]
pub(super) fn _clear_faults() -> Vec<&'static str> {
    fault::clear().into_iter().map(|(p, _)| p.name()).collect()
}

/// Test only: start logging every fault point reached, in order.
#[pyfunction]
pub(super) fn _record_ops() -> PyResult<()> {
    fault::record()?;
    Ok(())
}

/// Test only: the points logged since `_record_ops` ("point file-name").
#[pyfunction]
pub(super) fn _op_log() -> Vec<String> {
    fault::take_log()
}
