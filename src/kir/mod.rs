//! kir
