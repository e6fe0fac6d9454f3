//! Typed, named access to the keys of a `config.json` object.

use serde_json::{Map, Value};

use crate::{Error, Result};

/// Typed access to the keys of one config object; errors name the file and the key.
pub(super) struct Keys<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) source: &'a str,
}

impl<'a> Keys<'a> {
    pub(super) fn err(&self, key: &str, what: impl std::fmt::Display) -> Error {
        Error::Model(format!("{}: key `{key}` {what}", self.source))
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub(super) fn req(&self, key: &str) -> Result<&'a Value> {
        self.get(key).ok_or_else(|| {
            self.err(
                key,
                "is missing (the forward pass needs it; nothing is guessed)",
            )
        })
    }

    pub(super) fn usize_of(&self, key: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.err(key, format!("must be a non-negative integer, found {v}")))
    }

    pub(super) fn usize(&self, key: &str) -> Result<usize> {
        self.usize_of(key, self.req(key)?)
    }

    pub(super) fn positive(&self, key: &str) -> Result<usize> {
        let v = self.usize(key)?;
        if v == 0 {
            return Err(self.err(key, "must be at least 1, found 0"));
        }
        Ok(v)
    }

    /// A positive integer no larger than `max` (see [`super::limits`]).
    pub(super) fn bounded(&self, key: &str, max: usize) -> Result<usize> {
        let v = self.positive(key)?;
        self.at_most(key, v, max)
    }

    /// `v` (the value of `key`) no larger than `max`.
    pub(super) fn at_most(&self, key: &str, v: usize, max: usize) -> Result<usize> {
        if v > max {
            return Err(self.err(
                key,
                format!("is {v}, more than this runner accepts ({max}); no GLM-5 or DeepSeek-V3.2 checkpoint comes near it"),
            ));
        }
        Ok(v)
    }

    /// A finite number that stays finite (and non-zero when `nonzero`) as an f32.
    pub(super) fn f32_of(&self, key: &str, v: f64, nonzero: bool) -> Result<f32> {
        let x = v as f32;
        if !x.is_finite() {
            return Err(self.err(
                key,
                format!("is {v:e}, outside the f32 range the kernels compute in (|x| < 3.4e38)"),
            ));
        }
        if nonzero && x == 0.0 {
            return Err(self.err(
                key,
                format!("is {v:e}, which is 0 as an f32 (the kernels compute in f32; smallest normal 1.2e-38)"),
            ));
        }
        Ok(x)
    }

    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.usize_of(key, v)).transpose()
    }

    pub(super) fn f64_of(&self, key: &str, v: &Value) -> Result<f64> {
        v.as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.err(key, format!("must be a finite number, found {v}")))
    }

    pub(super) fn f64(&self, key: &str) -> Result<f64> {
        self.f64_of(key, self.req(key)?)
    }

    pub(super) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| self.f64_of(key, v)).transpose()
    }

    pub(super) fn bool_of(&self, key: &str, v: &Value) -> Result<bool> {
        v.as_bool()
            .ok_or_else(|| self.err(key, format!("must be true or false, found {v}")))
    }

    pub(super) fn bool(&self, key: &str) -> Result<bool> {
        self.bool_of(key, self.req(key)?)
    }

    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| self.bool_of(key, v)).transpose()
    }

    pub(super) fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(key, format!("must be a string, found {v}")))
            })
            .transpose()
    }

    pub(super) fn opt_str_list(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, format!("must be a list of strings, found {v}")))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.err(key, format!("must hold strings only, found {x}")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// A key the model type fixes: absent is fine, present must agree.
    pub(super) fn must_agree_bool(&self, key: &str, implied: bool, why: &str) -> Result<()> {
        match self.opt_bool(key)? {
            Some(v) if v != implied => Err(self.err(
                key,
                format!("is {v}, but {why}; refusing to guess which one the checkpoint was trained with"),
            )),
            _ => Ok(()),
        }
    }
}
