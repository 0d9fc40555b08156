"""mirrored.datasets: named datasets as tfds.load gives them (cassava, digits, image folders, and
any image-classification dataset TFDS has prepared)."""
from mirrored.data.tfds import DatasetInfo as DatasetInfo
from mirrored.data.tfds import ReadConfig as ReadConfig
from mirrored.datasets.cassava import DownloadConfig as DownloadConfig
from mirrored.datasets.registry import builder as builder
from mirrored.datasets.registry import image_folder as image_folder
from mirrored.datasets.registry import list_builders as list_builders
from mirrored.datasets.registry import load as load
