# The NCCL engine (csrc/nccl) and its world-size-1 check executable. Host code only: the
# engine launches no kernels of its own (ncclAvg does the averaging), so nothing is compiled by
# nvcc; the CUDA toolkit (found through nvcc) provides the runtime headers and library.
find_package(CUDAToolkit REQUIRED)

set(_nccl_hints ${ZKERNELS_NCCL_ROOT} $ENV{ZKERNELS_NCCL_ROOT})
find_path(ZK_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include REQUIRED)
# The pip wheel ships only the soname libnccl.so.2 (no libnccl.so link): name it exactly.
find_library(ZK_NCCL_LIBRARY NAMES libnccl.so.2 nccl HINTS ${_nccl_hints}
             PATH_SUFFIXES lib lib64 REQUIRED)
get_filename_component(_nccl_lib_dir "${ZK_NCCL_LIBRARY}" DIRECTORY)
message(STATUS "zkernels: NCCL ${ZK_NCCL_INCLUDE_DIR} ${ZK_NCCL_LIBRARY}")

# Where the loader finds libnccl.so.2 at run time: the folder it was built against, and the
# nvidia-nccl wheel's folder relative to an installed zkernels/ (site-packages/nvidia/nccl/lib).
# When torch (CUDA) is imported first its libnccl.so.2 is already loaded and is reused.
set(ZK_NCCL_RPATH "${_nccl_lib_dir};\$ORIGIN/../nvidia/nccl/lib")

add_library(zk_nccl_engine STATIC csrc/nccl/engine.cpp csrc/nccl/handle.cpp)
target_include_directories(zk_nccl_engine PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc
                                                 ${ZK_NCCL_INCLUDE_DIR})
target_compile_options(zk_nccl_engine PRIVATE -O2 -Wall -Wextra)
# Static cudart: the module needs no libcudart.so.13 on the loader path; streams and events
# are driver objects, so torch's runtime and ours share them through the primary context.
find_package(Threads REQUIRED)
target_link_libraries(zk_nccl_engine PUBLIC CUDA::cudart_static ${ZK_NCCL_LIBRARY}
                                            Threads::Threads)

if(ZKERNELS_BUILD_TESTS)
  add_executable(check_nccl_engine tests/native/cpp/check_nccl_engine.cpp)
  target_link_libraries(check_nccl_engine PRIVATE zk_nccl_engine)
  set_target_properties(check_nccl_engine PROPERTIES BUILD_RPATH "${ZK_NCCL_RPATH}")
  # Needs a GPU: registered under a label so `ctest -LE gpu` runs everything else.
  add_test(NAME nccl_engine_ws1 COMMAND check_nccl_engine)
  set_tests_properties(nccl_engine_ws1 PROPERTIES LABELS gpu)
endif()
