# Finds trainloop's dependencies and attaches them to a target. Shared by the build tree and by
# the installed package config, so a consumer gets exactly what the tests were built with.
include(CMakeFindDependencyMacro)

macro(trainloop_find_dependencies)
  find_dependency(Threads)
  find_dependency(ZLIB)
  find_dependency(range-v3)
  find_dependency(Torch)
endmacro()
trainloop_find_dependencies()

function(trainloop_link_dependencies target)
  target_link_libraries(${target} INTERFACE ${TORCH_LIBRARIES} range-v3::range-v3 ZLIB::ZLIB Threads::Threads)
  # TorchConfig.cmake defines neither c10d backend macro, yet ProcessGroupGloo.hpp and
  # ProcessGroupNCCL.hpp are empty without them.
  target_compile_definitions(${target} INTERFACE USE_C10D_GLOO)
  if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND)
    target_compile_definitions(${target} INTERFACE USE_C10D_NCCL TRAINLOOP_WITH_CUDA=1)
  endif()
endfunction()
