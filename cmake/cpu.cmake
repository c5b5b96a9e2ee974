# The CPU core: zk_cpu_isa (run-time ISA detection) and, through zk_cpu_library, one static
# library per csrc/<name>/ folder, each with its C++ test tests/native/cpp/test_<name>.cpp.
#
# -fno-math-errno: sqrt compiles to the instruction (no errno branch); -ffp-contract=off: no
# silent FMA contraction, so the scalar, AVX2 and AVX-512 paths round identically. The SIMD
# paths carry their own target attributes (csrc/simd/); the libraries stay baseline x86-64.
set(ZK_CPU_FLAGS -O3 -fno-math-errno -ffp-contract=off -Wall -Wextra
    -Wno-maybe-uninitialized)  # GCC 12 intrinsic headers: `__m512 __Y = __Y` idiom

add_library(zk_cpu_isa STATIC csrc/simd/isa.cpp)
target_include_directories(zk_cpu_isa PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
target_compile_options(zk_cpu_isa PRIVATE ${ZK_CPU_FLAGS})

# zk_cpu_library(<name>): zk_<name> from csrc/<name>/{<name>,path_avx2,path_avx512}.cpp, and
# (ZKERNELS_BUILD_TESTS) the CTest `<name>` running test_<name>, which links only that library.
function(zk_cpu_library name)
  set(dir ${CMAKE_CURRENT_SOURCE_DIR}/csrc/${name})
  add_library(zk_${name} STATIC ${dir}/${name}.cpp ${dir}/path_avx2.cpp ${dir}/path_avx512.cpp)
  target_include_directories(zk_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc PRIVATE ${dir})
  target_compile_options(zk_${name} PRIVATE ${ZK_CPU_FLAGS})
  target_link_libraries(zk_${name} PUBLIC zk_cpu_isa OpenMP::OpenMP_CXX)
  if(ZKERNELS_BUILD_TESTS)
    add_executable(test_${name} ${CMAKE_CURRENT_SOURCE_DIR}/tests/native/cpp/test_${name}.cpp)
    target_compile_options(test_${name} PRIVATE -O2 -ffp-contract=off -fno-math-errno -Wall)
    target_link_libraries(test_${name} PRIVATE zk_${name})
    add_test(NAME ${name} COMMAND test_${name})
  endif()
endfunction()

zk_cpu_library(cpu_adam)
zk_cpu_library(cpu_ops)
zk_cpu_library(cpu_quant)
zk_cpu_library(cpu_optim)
zk_cpu_library(cpu_adam_lowbit)
