//! The mixed-precision policy: the dtypes of main parameters, main gradients and gradient
//! communication (Megatron-FSDP's `MixedPrecisionPolicy`).

use lowbit_layout::{GradDType, ParamStorage};

/// The dtype of the main (optimizer) parameters ([`super::FsdpConfig::master_dtype`]).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MainParamsDtype {
    /// fp32 masters, sharded with the optimizer state (the default).
    #[default]
    #[cfg_attr(feature = "clap", value(name = "fp32"))]
    Fp32,
    /// bf16 masters: half the bytes; each step's result is rounded to bf16.
    #[cfg_attr(feature = "clap", value(name = "bf16"))]
    Bf16,
    /// No masters of their own: the (bf16) compute weights are the main parameters; refused
    /// for low-precision weights, which cannot hold them.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "none",
            help = "No masters: the bf16 compute weights are the main parameters"
        )
    )]
    None,
}

impl MainParamsDtype {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            MainParamsDtype::Fp32 => "fp32",
            MainParamsDtype::Bf16 => "bf16",
            MainParamsDtype::None => "none",
        }
    }
}

/// The dtype of the main gradients: where microbatches accumulate.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MainGradsDtype {
    /// fp32 (the default).
    #[default]
    #[cfg_attr(feature = "clap", value(name = "fp32"))]
    Fp32,
    /// bf16.
    #[cfg_attr(feature = "clap", value(name = "bf16"))]
    Bf16,
    /// The compute dtype: the parameter's dtype, bf16 for low-precision parameters (Megatron's
    /// rule for quantized parameters).
    #[cfg_attr(
        feature = "clap",
        value(
            name = "compute",
            help = "The compute dtype (bf16 for bf16 and low-precision weights)"
        )
    )]
    Compute,
}

impl MainGradsDtype {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            MainGradsDtype::Fp32 => "fp32",
            MainGradsDtype::Bf16 => "bf16",
            MainGradsDtype::Compute => "compute",
        }
    }

    /// The gradient dtype of a parameter stored as `storage`.
    pub fn resolve(self, storage: ParamStorage) -> GradDType {
        match self {
            MainGradsDtype::Fp32 => GradDType::F32,
            MainGradsDtype::Bf16 => GradDType::Bf16,
            MainGradsDtype::Compute => match storage {
                ParamStorage::F32 => GradDType::F32,
                _ => GradDType::Bf16,
            },
        }
    }
}

/// The dtype gradients are reduced in.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum CommDtype {
    /// The main-gradient dtype: no extra bucket.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(name = "auto", help = "The main-gradient dtype")
    )]
    MainGrads,
    /// fp32.
    #[cfg_attr(feature = "clap", value(name = "fp32"))]
    Fp32,
    /// bf16: half the bytes on the wire; the reduction still sums in f32 and rounds once.
    #[cfg_attr(feature = "clap", value(name = "bf16"))]
    Bf16,
}

impl CommDtype {
    /// The lower-case name (the command line's spelling; `auto` for the main-gradient dtype).
    pub fn name(self) -> &'static str {
        match self {
            CommDtype::MainGrads => "auto",
            CommDtype::Fp32 => "fp32",
            CommDtype::Bf16 => "bf16",
        }
    }

    /// The buffers' setting (`None`: the main-gradient dtype).
    pub fn grad_dtype(self) -> Option<GradDType> {
        match self {
            CommDtype::MainGrads => None,
            CommDtype::Fp32 => Some(GradDType::F32),
            CommDtype::Bf16 => Some(GradDType::Bf16),
        }
    }
}

/// The three dtypes. The policy may change between iterations (rebuild the buffers' config
/// with [`super::FsdpConfig::ddp_config`]; the communication dtype is read at every reduction).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MixedPrecisionPolicy {
    /// Main parameters.
    pub main_params_dtype: MainParamsDtype,
    /// Main gradients.
    pub main_grads_dtype: MainGradsDtype,
    /// Gradient communication.
    pub grad_comm_dtype: CommDtype,
}

impl MixedPrecisionPolicy {
    lowbit_layout::setters! {
        /// Sets the main-parameter dtype.
        with_main_params_dtype => main_params_dtype: MainParamsDtype;
        /// Sets the main-gradient dtype.
        with_main_grads_dtype => main_grads_dtype: MainGradsDtype;
        /// Sets the communication dtype.
        with_grad_comm_dtype => grad_comm_dtype: CommDtype;
    }
}
