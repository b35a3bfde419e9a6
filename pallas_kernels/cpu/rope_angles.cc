// cos and sin of each token's rotary angles, as an XLA FFI custom call: angle[t][i] = float(positions[t]) *
// inv_freq[i] in float32, its cos and sin in float32 (libm's cosf/sinf, the functions XLA:CPU itself calls for
// jnp.cos/jnp.sin), so the tables equal the plain-JAX ones.
// Its own call because XLA:CPU would otherwise fuse cos/sin into every consumer and take them per element,
// query head and layer through scalar libm calls; the rotations then read these [T, D/2] tables.
//
// Shapes: positions s32[T]; inv_freq f32[H]. Outputs cos f32[T, H], sin f32[T, H].

#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RopeAngles(ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                      ffi::ResultBuffer<ffi::F32> cos_out, ffi::ResultBuffer<ffi::F32> sin_out) {
  const auto pd = positions.dimensions(), fd = inv_freq.dimensions(), od = cos_out->dimensions();
  if (pd.size() != 1 || fd.size() != 1 || od.size() != 2 || od[0] != pd[0] || od[1] != fd[0]) {
    return ffi::Error::InvalidArgument("rope_angles: positions [T], inv_freq [H], outputs [T, H]");
  }
  const int32_t* pos = positions.typed_data();
  const float* freq = inv_freq.typed_data();
  float* c = cos_out->typed_data();
  float* s = sin_out->typed_data();
  const int64_t t = pd[0], h = fd[0];
  for (int64_t i = 0; i < t; ++i) {
    const float p = static_cast<float>(pos[i]);
    for (int64_t j = 0; j < h; ++j) {
      const float angle = p * freq[j];
      c[i * h + j] = std::cos(angle);
      s[i * h + j] = std::sin(angle);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRopeAngles, RopeAngles,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .Ret<ffi::Buffer<ffi::F32>>()   // cos
                                  .Ret<ffi::Buffer<ffi::F32>>());  // sin
