//! A PyTorch tensor as Python describes it, and the checks every op runs on one. Each error
//! names the op, the argument, what was expected and what was given.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::PyResult;

/// `(data_ptr, shape, strides in elements, dtype without "torch.", device type, device index)`.
pub type Desc = (u64, Vec<i64>, Vec<i64>, String, String, i64);

pub struct Tensor {
    pub name: &'static str,
    pub ptr: u64,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    pub dtype: String,
    pub device_type: String,
    pub device_index: i64,
}

impl Tensor {
    pub fn new(name: &'static str, d: Desc) -> Self {
        let (ptr, shape, strides, dtype, device_type, device_index) = d;
        Tensor {
            name,
            ptr,
            shape,
            strides,
            dtype: dtype.trim_start_matches("torch.").to_string(),
            device_type,
            device_index,
        }
    }

    fn device_text(&self) -> String {
        if self.device_type == "cuda" {
            format!("cuda:{}", self.device_index)
        } else {
            self.device_type.clone()
        }
    }

    /// The CUDA device ordinal of the first tensor of a call.
    pub fn cuda_device(&self, op: &str) -> PyResult<usize> {
        if self.device_type != "cuda" || self.device_index < 0 {
            return Err(PyValueError::new_err(format!(
                "{op}: `{}`: expected a CUDA tensor, got one on {}",
                self.name,
                self.device_text()
            )));
        }
        Ok(self.device_index as usize)
    }

    pub fn same_device(&self, op: &str, device: usize) -> PyResult<()> {
        if self.device_type != "cuda" || self.device_index != device as i64 {
            return Err(PyValueError::new_err(format!(
                "{op}: `{}`: expected a tensor on cuda:{device} (the device of the call's first tensor), got one on {}",
                self.name,
                self.device_text()
            )));
        }
        Ok(())
    }

    pub fn rank(&self, op: &str, rank: usize, layout: &str) -> PyResult<()> {
        if self.shape.len() != rank || self.strides.len() != rank {
            return Err(PyValueError::new_err(format!(
                "{op}: `{}`: expected {rank} dimensions {layout}, got shape {:?}",
                self.name, self.shape
            )));
        }
        Ok(())
    }

    pub fn dim(&self, op: &str, i: usize, want: i64, layout: &str) -> PyResult<()> {
        if self.shape[i] != want {
            return Err(PyValueError::new_err(format!(
                "{op}: `{}`: expected shape {layout} (dimension {i} = {want}), got {:?}",
                self.name, self.shape
            )));
        }
        Ok(())
    }

    pub fn dtype(&self, op: &str, allowed: &[&str]) -> PyResult<()> {
        if !allowed.contains(&self.dtype.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "{op}: `{}`: expected dtype {}, got {}",
                self.name,
                allowed.join(" or "),
                self.dtype
            )));
        }
        Ok(())
    }

    /// Row-major with no gaps (dimensions of size 1 may have any stride).
    pub fn contiguous(&self, op: &str) -> PyResult<()> {
        let mut want = 1i64;
        for (d, s) in self.shape.iter().zip(&self.strides).rev() {
            if *d != 1 && *s != want {
                return Err(PyValueError::new_err(format!(
                    "{op}: `{}`: expected a contiguous tensor (call .contiguous()), got shape {:?} with strides {:?}",
                    self.name, self.shape, self.strides
                )));
            }
            want *= *d;
        }
        Ok(())
    }

    pub fn aligned(&self, op: &str, bytes: u64) -> PyResult<()> {
        if self.ptr % bytes != 0 {
            return Err(PyValueError::new_err(format!(
                "{op}: `{}`: expected a data pointer aligned to {bytes} bytes (the kernels access it {bytes} bytes at a time), got 0x{:x}",
                self.name, self.ptr
            )));
        }
        Ok(())
    }

    pub fn elem_bytes(&self) -> u64 {
        match self.dtype.as_str() {
            "bfloat16" | "float16" | "int16" => 2,
            "float32" | "int32" => 4,
            "float64" | "int64" => 8,
            _ => 1,
        }
    }
}
