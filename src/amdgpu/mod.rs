//! AMD GPUs through the KFD driver (`/dev/kfd`).

pub mod image;
pub mod topology;
